// Dequantization of a whole MLX affine weight into a dense buffer: out[n, k] = scale * q + bias, q the 4- or 8-bit
// code of W[n, k] packed in uint32 words (element 0 in the low bits), scale/bias shared by 64 consecutive k.
//
//   dequantize_q<b>_g64_<dtype>[_sf32]   the IN_GEMM_DEQUANT ablation only (docs/engine.md, "Switches"): prefill
//                                        GEMMs first expand the weight into an engine scratch buffer in the
//                                        activation dtype, then the dense mm_* GEMM (metal/qmatmul.metal) reads it.
//                                        Never chosen by default: qmm dequantizes tile by tile in threadgroup memory.
//                                        Grid (ceil(N * K * b / 32 / LILY_DEQUANTIZE_THREADS), 1, 1) x
//                                        LILY_DEQUANTIZE_THREADS; one thread per packed word, writing 32 / b
//                                        consecutive outputs. Reads the weight, scales and biases once (coalesced),
//                                        writes N * K elements: at 4 bits and bf16 the pass moves 4.5x the bytes of
//                                        the weight it expands, which the mm GEMM then reads again.
// dtype is the output dtype (f32, bf16); scales and biases are bf16 unless the name has _sf32. One rounding per
// element (fp32 scale * q + bias, then to the dtype: exact in f32 mode).
#include <metal_stdlib>
#include "lily.h"
#include "quantized.h"

using namespace metal;

template <typename T, typename S, int Bits>
[[kernel]] void dequantize(constant lily::DequantizeArgs& args [[buffer(0)]],
                           device const uint* weight [[buffer(1)]],
                           device const S* scales [[buffer(2)]],
                           device const S* biases [[buffer(3)]],
                           device T* out [[buffer(4)]],
                           uint word_index [[thread_position_in_grid]]) {
  constexpr uint kPerWord = lily::codes_per_word<Bits>();
  const uint K = args.in_features;
  const size_t words = size_t(args.out_features) * (K / kPerWord);
  if (size_t(word_index) >= words) {
    return;
  }
  // Element index of this word's first code; a word never straddles a group (kPerWord divides 64).
  const size_t first = size_t(word_index) * kPerWord;
  // Rows hold K / 64 groups each, so the flat group index is the scale's.
  const size_t group = first / lily::kQuantGroupSize;
  const float scale = float(scales[group]);
  const float bias = float(biases[group]);
  const uint word = weight[word_index];
  for (uint e = 0; e < kPerWord; ++e) {
    out[first + e] = T(lily::dequantize_code<Bits>(word, e, scale, bias));
  }
}

LILY_INSTANTIATE_KERNEL("dequantize_q4_g64_f32", dequantize, float, bfloat, 4)
LILY_INSTANTIATE_KERNEL("dequantize_q4_g64_bf16", dequantize, bfloat, bfloat, 4)
LILY_INSTANTIATE_KERNEL("dequantize_q4_g64_f32_sf32", dequantize, float, float, 4)
LILY_INSTANTIATE_KERNEL("dequantize_q4_g64_bf16_sf32", dequantize, bfloat, float, 4)
LILY_INSTANTIATE_KERNEL("dequantize_q8_g64_f32", dequantize, float, bfloat, 8)
LILY_INSTANTIATE_KERNEL("dequantize_q8_g64_bf16", dequantize, bfloat, bfloat, 8)
LILY_INSTANTIATE_KERNEL("dequantize_q8_g64_f32_sf32", dequantize, float, float, 8)
LILY_INSTANTIATE_KERNEL("dequantize_q8_g64_bf16_sf32", dequantize, bfloat, float, 8)
