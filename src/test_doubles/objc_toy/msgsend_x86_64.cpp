// objc_msgSend for the toy runtime (x86-64 System V). It saves every argument register, asks
// objc_toy_lookup_imp for the method of (isa, selector), restores the registers and the stack
// pointer, and tail-jumps: stack arguments (MTLSize passed by value) reach the method
// untouched, and the method returns straight to the caller. A nil receiver returns zero.
#if !defined(__x86_64__)
#error "the toy objc_msgSend trampoline is written for x86-64"
#endif

asm(R"(
  .text
  .globl objc_msgSend
  .hidden objc_msgSend
  .type objc_msgSend, @function
  .p2align 4
objc_msgSend:
  .cfi_startproc
  testq %rdi, %rdi
  jz 1f
  pushq %rbp
  .cfi_def_cfa_offset 16
  .cfi_offset %rbp, -16
  movq %rsp, %rbp
  .cfi_def_cfa_register %rbp
  subq $192, %rsp
  movq %rdi, 0(%rsp)
  movq %rsi, 8(%rsp)
  movq %rdx, 16(%rsp)
  movq %rcx, 24(%rsp)
  movq %r8, 32(%rsp)
  movq %r9, 40(%rsp)
  movq %rax, 48(%rsp)
  movaps %xmm0, 64(%rsp)
  movaps %xmm1, 80(%rsp)
  movaps %xmm2, 96(%rsp)
  movaps %xmm3, 112(%rsp)
  movaps %xmm4, 128(%rsp)
  movaps %xmm5, 144(%rsp)
  movaps %xmm6, 160(%rsp)
  movaps %xmm7, 176(%rsp)
  call objc_toy_lookup_imp@PLT
  movq %rax, %r11
  movq 0(%rsp), %rdi
  movq 8(%rsp), %rsi
  movq 16(%rsp), %rdx
  movq 24(%rsp), %rcx
  movq 32(%rsp), %r8
  movq 40(%rsp), %r9
  movq 48(%rsp), %rax
  movaps 64(%rsp), %xmm0
  movaps 80(%rsp), %xmm1
  movaps 96(%rsp), %xmm2
  movaps 112(%rsp), %xmm3
  movaps 128(%rsp), %xmm4
  movaps 144(%rsp), %xmm5
  movaps 160(%rsp), %xmm6
  movaps 176(%rsp), %xmm7
  leave
  .cfi_def_cfa %rsp, 8
  jmpq *%r11
1:
  xorl %eax, %eax
  xorl %edx, %edx
  pxor %xmm0, %xmm0
  pxor %xmm1, %xmm1
  ret
  .cfi_endproc
  .size objc_msgSend, .-objc_msgSend
)");
