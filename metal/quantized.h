// MLX affine quantization as the kernels read it, one definition for every bit width: a weight row is packed in
// uint32 words of 32 / Bits codes (element 0 in the low bits) and w = scale · q + bias with one scale and bias per
// group of 64 consecutive elements (a word never straddles a group). Used by embedding, dequantize, qmatmul, moe and
// moe_prefill.
#ifndef LILY_QUANTIZED_H
#define LILY_QUANTIZED_H

#include <metal_stdlib>
#include "lily.h"

namespace lily {

enum : uint { kQuantGroupSize = 64 };  // elements per scale/bias group

template <int Bits>
constexpr uint codes_per_word() {
  static_assert(Bits == 4 || Bits == 8, "MLX affine codes of 4 or 8 bits");
  return 32 / Bits;
}

// Code e of a packed word.
template <int Bits>
inline uint unpack_code(uint word, uint e) {
  return (word >> (e * Bits)) & ((1u << Bits) - 1u);
}

// The weight value of code e: scale · q + bias, in fp32.
template <int Bits>
inline float dequantize_code(uint word, uint e, float scale, float bias) {
  return scale * float(unpack_code<Bits>(word, e)) + bias;
}

// Code e of a packed word as a float, with neither a shift per code nor an int-to-float conversion (the decode GEMVs,
// qmv_* and moe_*, are issue-bound on the unpacking). The code sits at bit offset o of `word` while it ends below the
// float's exponent (bit 23), else of word >> 16; it is masked in place into the mantissa of 2^(23 - o)
// (`magic[o / Bits]`, its bits), whose mantissa unit is then exactly 1: the float is 2^(23 - o) + q, and subtracting
// 2^(23 - o) leaves q exactly. Two operations per code (on NVIDIA GPUs one three-input logic op and an add), one shift
// per word (`word_high` = word >> 16), and x needs no pre-scaling.
template <int Bits>
constexpr uint code_float_offset(uint e) {
  return e * Bits + Bits <= 23 ? e * Bits : e * Bits - 16;
}
template <int Bits>
constexpr uint kCodeMagicCount = 16 / Bits + 1;

// The bits of 2^(23 - o) for each code offset o (a multiple of Bits up to 16), as register values (a broadcast the
// compiler cannot fold): with a constant in a register, a code's mask and or are one three-input logic op on NVIDIA
// GPUs, not two. Called by a whole simdgroup.
template <int Bits>
LILY_INLINE void code_float_magic(thread uint* magic) {
  LILY_UNROLL
  for (uint i = 0; i < kCodeMagicCount<Bits>; ++i) {
    magic[i] = metal::simd_broadcast_first((150u - i * Bits) << 23);
  }
}

template <int Bits>
LILY_INLINE float code_float(uint word, uint word_high, uint e, thread const uint* magic) {
  constexpr uint kMask = (1u << Bits) - 1u;
  const uint o = code_float_offset<Bits>(e);
  const uint m = magic[o / Bits];
  const uint bits = ((e * Bits + Bits <= 23 ? word : word_high) & (kMask << o)) | m;
  return metal::as_type<float>(bits) - metal::as_type<float>(m);
}

}  // namespace lily

#endif  // LILY_QUANTIZED_H
