// Scalar activations shared by the kernels (metal/*.metal), evaluated in fp32 with precise::exp so every kernel
// that applies one gives the same bits.
#ifndef LILY_ACTIVATIONS_H
#define LILY_ACTIVATIONS_H

#include <metal_stdlib>

namespace lily {

inline float sigmoid(float x) {
  return 1.0f / (1.0f + metal::precise::exp(-x));
}

inline float silu(float x) {
  return x / (1.0f + metal::precise::exp(-x));
}

}  // namespace lily

#endif  // LILY_ACTIVATIONS_H
