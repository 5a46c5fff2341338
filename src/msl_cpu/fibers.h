// Fiber context switching for the harness: one fiber per GPU thread.
// x86-64 uses a hand-written switch (callee-saved registers, MXCSR and the x87 control word only);
// ucontext's swapcontext makes a sigprocmask syscall per switch and is several times slower.
// Other architectures fall back to ucontext.
#pragma once

#include <cstddef>

#if !defined(__x86_64__) || defined(MSL_RT_UCONTEXT)
#include <ucontext.h>
#endif

namespace msl_rt {

struct FiberContext {
#if defined(__x86_64__) && !defined(MSL_RT_UCONTEXT)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

using FiberEntry = void (*)(void* arg);

// Prepares `ctx` to run entry(arg) on [stack, stack + size) at its first switch_to. entry must never return.
void fiber_init(FiberContext& ctx, void* stack, size_t size, FiberEntry entry, void* arg);
// Saves the running context into `from` and resumes `to`.
void fiber_switch(FiberContext& from, FiberContext& to);

}  // namespace msl_rt
