// The Objective-C runtime entry points the Metal binding calls, from Apple's libobjc on macOS
// and from the toy runtime (src/test_doubles/objc_toy) on Linux. Plain C++: no Objective-C++ anywhere.
#pragma once

#if defined(__APPLE__)
#include <objc/message.h>
#include <objc/runtime.h>

extern "C" {
// Exported by libobjc (clang emits them for @autoreleasepool) but absent from public headers.
void* objc_autoreleasePoolPush(void);
void objc_autoreleasePoolPop(void* pool);
// Block runtime (libsystem_blocks), for the hand-built completion-handler block.
extern void* _NSConcreteStackBlock[32];
// Metal.framework; returns +1.
id MTLCreateSystemDefaultDevice(void);
}
#else
#include "../../test_doubles/objc_toy/objc_toy.h"

extern "C" id MTLCreateSystemDefaultDevice(void);
#endif
