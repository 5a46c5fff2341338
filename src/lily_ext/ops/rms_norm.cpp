// rms_norm_<dtype>, rms_norm_residual_<dtype> (metal/rms_norm.metal): one threadgroup per row.
#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

namespace {
RmsNormArgs norm_args(size_t row_length, float eps) {
  RmsNormArgs a{};
  a.row_length = static_cast<u32>(row_length);
  a.eps = eps;
  return a;
}
}  // namespace

void rms_norm(Context& ctx, const std::string& label, const Span& x, const WeightRef& weight, const Span& out,
              size_t rows, size_t row_length, float eps) {
  add_node(ctx, std::string("rms_norm_") + dtype_name(ctx.act), label,
           {arg_value(norm_args(row_length, eps)), arg(x), arg(weight.data), arg(out)},
           {rows, 1, 1}, {tuning::kRmsNormThreads, 1, 1}, {x, weight.data}, {out});
}

void rms_norm_residual(Context& ctx, const std::string& label, const Span& x, const Span& residual,
                       const WeightRef& weight, const Span& out, const Span& sum, size_t rows, size_t row_length,
                       float eps) {
  add_node(ctx, std::string("rms_norm_residual_") + dtype_name(ctx.act), label,
           {arg_value(norm_args(row_length, eps)), arg(x), arg(residual), arg(weight.data), arg(out), arg(sum)},
           {rows, 1, 1}, {tuning::kRmsNormThreads, 1, 1}, {x, residual, weight.data}, {out, sum});
}

}  // namespace lily::ops
