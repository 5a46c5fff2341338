// The Objective-C and Metal entry points of a Linux build without the Metal test runtime (CMakeLists.txt: it needs
// clang on x86-64). The binding links and the extension loads; its first use of Metal says what the build lacks.
#include "mtl.h"
#include "objc_api.h"

namespace {

[[noreturn]] void no_metal_runtime() {
  throw lily::mtl::Error("[metal] lily was built without the Metal test runtime (needs clang-19 on x86-64)");
}

}  // namespace

extern "C" {

// Selectors are registered while the library loads (mtl.cpp): give each a distinct, never-sent value.
SEL sel_registerName(const char* name) { return reinterpret_cast<SEL>(name); }
const char* sel_getName(SEL sel) { return reinterpret_cast<const char*>(sel); }
Class objc_getClass(const char*) { no_metal_runtime(); }
id MTLCreateSystemDefaultDevice(void) { no_metal_runtime(); }
void objc_msgSend(void) { no_metal_runtime(); }
void* objc_autoreleasePoolPush(void) { return nullptr; }
void objc_autoreleasePoolPop(void*) {}
void* _NSConcreteStackBlock[32];

}  // extern "C"
