// dequantize_* (metal/dequantize.metal): the whole quantized weight written densely in the activation dtype, one
// thread per packed word. Only the IN_GEMM_DEQUANT ablation runs it, in front of mm_* (mm.cpp).
#include <stdexcept>

#include "../../../metal/lily.h"
#include "ops.h"

namespace lily::ops {

Span dequantize(Context& ctx, const std::string& label, const WeightRef& w, const Span& scratch, DType dtype) {
  const size_t dense_bytes = w.rows * w.cols * dtype_size(dtype);
  if (dense_bytes > scratch.length) {
    throw std::logic_error("[graph] " + label + ": the dequantize scratch is smaller than the weight");
  }
  const Span dense = sub(scratch, 0, dense_bytes);
  DequantizeArgs d{};
  d.in_features = static_cast<u32>(w.cols);
  d.out_features = static_cast<u32>(w.rows);
  const size_t words = w.rows * w.cols * static_cast<size_t>(w.bits) / 32;
  std::string name = "dequantize_q" + std::to_string(w.bits) + "_g64_" + dtype_name(dtype);
  if (w.scale_dtype == DType::F32) name += "_sf32";
  add_node(ctx, name, label + " dequantize", {arg_value(d), arg(w.data), arg(w.scales), arg(w.biases), arg(dense)},
           {(words + LILY_DEQUANTIZE_THREADS - 1) / LILY_DEQUANTIZE_THREADS, 1, 1}, {LILY_DEQUANTIZE_THREADS, 1, 1},
           {w.data, w.scales, w.biases}, {dense});
  return dense;
}

}  // namespace lily::ops
