// mm_<dtype>_bm<BM> (metal/mm.metal): Y = X W^T with W dense in the activation dtype, qmm's grid and tiles. Only the
// IN_GEMM_DEQUANT ablation runs it, after dequantize_* (dequantize.cpp) expanded W into the scratch.
#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void mm(Context& ctx, const std::string& label, const Span& x, const Span& w, const Span& y, size_t rows,
        size_t in_features, size_t out_features, size_t bm, DType dtype) {
  QMatmulArgs a{};
  a.in_features = static_cast<u32>(in_features);
  a.out_features = static_cast<u32>(out_features);
  a.num_rows = static_cast<u32>(rows);
  add_node(ctx, std::string("mm_") + dtype_name(dtype) + "_bm" + std::to_string(bm), label,
           {arg_value(a), arg(x), arg(w), arg(y)},
           {(out_features + LILY_GEMM_BN - 1) / LILY_GEMM_BN, (rows + bm - 1) / bm, 1}, {tuning::kGemmThreads, 1, 1},
           {x, w}, {y});
}

}  // namespace lily::ops
