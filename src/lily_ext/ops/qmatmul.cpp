// qmv_*, qmm_* (metal/qmatmul.metal): Y = X W^T with W MLX affine-quantized, group 64.
#include <stdexcept>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void qmatmul(Context& ctx, const std::string& label, const Span& x, const WeightRef& w, const Span& y, size_t rows,
             DType dtype) {
  if (w.bits != 4 && w.bits != 8) throw std::logic_error("[graph] " + label + ": qmatmul needs a 4- or 8-bit weight");
  QMatmulArgs a{};
  a.in_features = static_cast<u32>(w.cols);
  a.out_features = static_cast<u32>(w.rows);
  a.num_rows = static_cast<u32>(rows);
  std::string name = rows <= tuning::kQmvMaxRows ? "qmv" : "qmm";
  name += "_q" + std::to_string(w.bits) + "_g64_" + dtype_name(dtype);
  if (w.scale_dtype == DType::F32) name += "_sf32";
  mtl::Size groups{(w.rows + tuning::kQmvRowsPerThreadgroup - 1) / tuning::kQmvRowsPerThreadgroup, rows, 1};
  mtl::Size threads{tuning::kQmvThreads, 1, 1};
  if (rows > tuning::kQmvMaxRows) {
    size_t bm = rows <= tuning::kQmmBm16MaxRows || !ctx.wide_tiles ? 16 : 32;
    name += bm == 16 ? "_bm16" : "_bm32";
    groups = {(w.rows + LILY_QMM_BN - 1) / LILY_QMM_BN, (rows + bm - 1) / bm, 1};
    threads = {bm == 16 ? 64u : 128u, 1, 1};
  }
  add_node(ctx, name, label, {arg_value(a), arg(x), arg(w.data), arg(w.scales), arg(w.biases), arg(y)}, groups,
           threads, {x, w.data, w.scales, w.biases}, {y});
}

}  // namespace lily::ops
