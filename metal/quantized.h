// MLX affine quantization as the kernels read it, one definition for every bit width: a weight row is packed in
// uint32 words of 32 / Bits codes (element 0 in the low bits) and w = scale · q + bias with one scale and bias per
// group of 64 consecutive elements (a word never straddles a group). Used by embedding, dequantize, qmatmul, moe and
// moe_prefill.
#ifndef LILY_QUANTIZED_H
#define LILY_QUANTIZED_H

#include <metal_stdlib>

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

// Σ_e q_e · x[e] over the codes of one word, in code order (the caller folds scale · dot + bias · Σx per group).
template <int Bits>
inline float dot_codes(uint word, thread const float* x) {
  float dot = 0.0f;
  for (uint e = 0; e < codes_per_word<Bits>(); ++e) {
    dot += float(unpack_code<Bits>(word, e)) * x[e];
  }
  return dot;
}

}  // namespace lily

#endif  // LILY_QUANTIZED_H
