// Fiber context switch (see fibers.h).
#include "fibers.h"

#include <cstdint>

#if defined(__x86_64__) && !defined(MSL_RT_UCONTEXT)

extern "C" void msl_rt_switch_stack(void** save_sp, void* load_sp);
extern "C" void msl_rt_fiber_trampoline();

// Frame saved on a fiber's stack, lowest address first: MXCSR + x87 control word, r15..r12, rbx, rbp, return address.
asm(R"(
  .text
  .p2align 4
  .globl msl_rt_switch_stack
  .hidden msl_rt_switch_stack
  .type msl_rt_switch_stack,@function
msl_rt_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size msl_rt_switch_stack, .-msl_rt_switch_stack

  .p2align 4
  .globl msl_rt_fiber_trampoline
  .hidden msl_rt_fiber_trampoline
  .type msl_rt_fiber_trampoline,@function
msl_rt_fiber_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size msl_rt_fiber_trampoline, .-msl_rt_fiber_trampoline
)");

namespace msl_rt {

void fiber_init(FiberContext& ctx, void* stack, size_t size, FiberEntry entry, void* arg) {
  auto top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  auto* frame = reinterpret_cast<uint64_t*>(top) - 8;  // 8 slots; rsp is 16-aligned again after the final ret
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  frame[0] = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
  frame[1] = 0;                                      // r15
  frame[2] = 0;                                      // r14
  frame[3] = reinterpret_cast<uint64_t>(entry);      // r13: called by the trampoline
  frame[4] = reinterpret_cast<uint64_t>(arg);        // r12: its argument
  frame[5] = 0;                                      // rbx
  frame[6] = 0;                                      // rbp
  frame[7] = reinterpret_cast<uint64_t>(&msl_rt_fiber_trampoline);
  ctx.sp = frame;
}

void fiber_switch(FiberContext& from, FiberContext& to) { msl_rt_switch_stack(&from.sp, to.sp); }

}  // namespace msl_rt

#else

namespace msl_rt {

void fiber_init(FiberContext& ctx, void* stack, size_t size, FiberEntry entry, void* arg) {
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = stack;
  ctx.uc.uc_stack.ss_size = size;
  ctx.uc.uc_link = nullptr;
  // makecontext passes int arguments only: split the pointer in two halves.
  auto bits = reinterpret_cast<uintptr_t>(arg);
  makecontext(&ctx.uc, reinterpret_cast<void (*)()>(+[](unsigned lo, unsigned hi, unsigned elo, unsigned ehi) {
                auto e = reinterpret_cast<FiberEntry>((uintptr_t(ehi) << 32) | elo);
                e(reinterpret_cast<void*>((uintptr_t(hi) << 32) | lo));
              }),
              4, unsigned(bits), unsigned(uint64_t(bits) >> 32), unsigned(reinterpret_cast<uintptr_t>(entry)),
              unsigned(uint64_t(reinterpret_cast<uintptr_t>(entry)) >> 32));
}

void fiber_switch(FiberContext& from, FiberContext& to) { swapcontext(&from.uc, &to.uc); }

}  // namespace msl_rt

#endif
