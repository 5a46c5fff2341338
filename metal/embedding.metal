// Embedding gather from an MLX affine-quantized table (codes [V, H*bits/32] uint32, element 0 in the low bits; scales
// and biases [V, H/64]): out[t, :] = scale * q + bias of row ids[ids_offset + t], rounded once to the activation dtype.
//   embedding_gather_q<b>_g64_<dtype>[_sf32]  one threadgroup of LILY_EMBEDDING_THREADS per token; grid (T, 1, 1).
//       Decode dispatches T = 1 with ids_offset = the slot the previous step's argmax/sample kernel wrote, so the token
//       never visits the CPU; prefill dispatches T tokens over an ids buffer the host filled.
//       An id >= vocab_size (a corrupt buffer) writes a row of NaN rather than reading outside the table.
// Reads one table row (H * bits / 8 bytes of codes plus H/64 scale/bias pairs, ~1.1 KB at H = 2048, 4 bits) and the id
// per token; writes H values. Consecutive threads read consecutive words (coalesced); no reuse to exploit.
// dtype is the activation dtype (f32, f16, bf16); scales/biases bf16, or f32 for the _sf32 variants (f16 scales are
// not instantiated: the host must refuse them). H % 64 == 0.
#include <metal_stdlib>
#include "lily.h"
#include "quantized.h"

using namespace metal;

template <typename T, typename S, int Bits>
[[kernel]] void embedding_gather(constant lily::EmbeddingArgs& args [[buffer(0)]],
                                 device const uint* ids [[buffer(1)]],
                                 device const uint* weight [[buffer(2)]],
                                 device const S* scales [[buffer(3)]],
                                 device const S* biases [[buffer(4)]],
                                 device T* out [[buffer(5)]],
                                 uint token [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint n_threads [[threads_per_threadgroup]]) {
  constexpr uint kPerWord = lily::codes_per_word<Bits>();
  const uint H = args.hidden_size;
  const uint id = ids[args.ids_offset + token];
  device T* out_row = out + size_t(token) * H;
  if (id >= args.vocab_size) {
    for (uint i = tid; i < H; i += n_threads) {
      out_row[i] = T(NAN);
    }
    return;
  }
  const uint words_per_row = H / kPerWord;
  device const uint* row = weight + size_t(id) * words_per_row;
  for (uint w = tid; w < words_per_row; w += n_threads) {
    const uint word = row[w];
    const uint k0 = w * kPerWord;
    const size_t g = size_t(id) * (H / lily::kQuantGroupSize) + k0 / lily::kQuantGroupSize;
    const float scale = float(scales[g]);
    const float bias = float(biases[g]);
    for (uint e = 0; e < kPerWord; ++e) {
      out_row[k0 + e] = T(lily::dequantize_code<Bits>(word, e, scale, bias));
    }
  }
}

LILY_INSTANTIATE_KERNEL("embedding_gather_q4_g64_f32", embedding_gather, float, bfloat, 4)
LILY_INSTANTIATE_KERNEL("embedding_gather_q4_g64_bf16", embedding_gather, bfloat, bfloat, 4)
LILY_INSTANTIATE_KERNEL("embedding_gather_q4_g64_f32_sf32", embedding_gather, float, float, 4)
LILY_INSTANTIATE_KERNEL("embedding_gather_q4_g64_bf16_sf32", embedding_gather, bfloat, float, 4)
LILY_INSTANTIATE_KERNEL("embedding_gather_q8_g64_f32", embedding_gather, float, bfloat, 8)
LILY_INSTANTIATE_KERNEL("embedding_gather_q8_g64_bf16", embedding_gather, bfloat, bfloat, 8)
LILY_INSTANTIATE_KERNEL("embedding_gather_q8_g64_f32_sf32", embedding_gather, float, float, 8)
LILY_INSTANTIATE_KERNEL("embedding_gather_q8_g64_bf16_sf32", embedding_gather, bfloat, float, 8)
