// gated_delta_step_<dtype>_dk<Dk> (metal/gated_delta.metal): one decode token of a DeltaNet layer, fused; the
// family's choice by token count (more tokens: gated_delta_prefill.cpp) and of the spread decode step.
#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void check_gated_delta_shapes(const ModelConfig& c) {
  // Key head dims with instantiated gated_delta_* kernels: 128 (the model's) and 64 (demo model, test fixtures).
  if (c.gdn_k_dim != 128 && c.gdn_k_dim != 64) {
    throw Error("[engine] config field linear_key_head_dim: the DeltaNet kernels are built for 128 and 64; got " +
                     std::to_string(c.gdn_k_dim));
  }
}

void gated_delta(Context& ctx, const ModelConfig& c, const std::string& label, const GatedDeltaSpans& s,
                 size_t tokens) {
  if (tokens == 1) {
    gated_delta_step(ctx, c, label, s);
  } else {
    gated_delta_prefill(ctx, c, label, s, tokens);
  }
}

GatedDeltaArgs gated_delta_args(const ModelConfig& c, size_t tokens) {
  GatedDeltaArgs a{};
  a.num_tokens = static_cast<u32>(tokens);
  a.num_k_heads = static_cast<u32>(c.gdn_k_heads);
  a.num_v_heads = static_cast<u32>(c.gdn_v_heads);
  a.head_v_dim = static_cast<u32>(c.gdn_v_dim);
  a.l2_eps = 1e-6f;  // the model's L2 norm uses a fixed eps, not rms_norm_eps
  a.norm_eps = c.eps;
  return a;
}

bool spread_deltanet_step(const Context& ctx, const ModelConfig& c, const std::vector<const WeightRef*>& in_proj,
                          const WeightRef& out_proj) {
  auto staged_4bit = [&](const WeightRef& w) {
    return w.bits == 4 && tuning::staged_gemv(ctx.staged_gemv, 4, w.scale_dtype == DType::BF16, w.cols, false);
  };
  return tuning::spread_deltanet_step(ctx.spread_deltanet_step, c.gdn_v_heads, c.gdn_v_dim) &&
         quantized_alike(in_proj) && staged_4bit(*in_proj[0]) && staged_4bit(out_proj);
}

void gated_delta_step(Context& ctx, const ModelConfig& c, const std::string& label, const GatedDeltaSpans& s) {
  const GatedDeltaArgs a = gated_delta_args(c, 1);
  // One threadgroup per key head; enough simdgroups that each holds LILY_GDN_ROWS_PER_SIMDGROUP state rows.
  size_t rows = (c.gdn_v_heads / c.gdn_k_heads) * c.gdn_v_dim;
  size_t simdgroups = (rows + tuning::kGdnRowsPerSimdgroup - 1) / tuning::kGdnRowsPerSimdgroup;
  std::string name = std::string("gated_delta_step_") + dtype_name(ctx.act) + "_dk" + std::to_string(c.gdn_k_dim);
  Node& node =
      add_node(ctx, name, label,
               {arg_value(a), arg(s.qkv), arg(s.z), arg(s.b), arg(s.a), arg(s.conv_weight->data), arg(s.a_log->data),
                arg(s.dt_bias->data), arg(s.norm_weight->data), arg(s.conv_state), arg(s.recurrent_state), arg(s.out)},
               {c.gdn_k_heads, 1, 1}, {32 * simdgroups, 1, 1},
               {s.qkv, s.z, s.b, s.a, s.conv_weight->data, s.a_log->data, s.dt_bias->data, s.norm_weight->data,
                s.conv_state, s.recurrent_state},
               {s.conv_state, s.recurrent_state, s.out});
  node.early_reads = {s.recurrent_state};  // its first batch of state rows (metal/gated_delta.metal)
}

}  // namespace lily::ops
