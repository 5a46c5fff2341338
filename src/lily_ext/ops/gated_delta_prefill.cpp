// Kernels of metal/gated_delta_prefill.metal: gated_delta_conv_* into conv_out, gated_delta_conv_state_*, the scan
// gated_delta_prefill[_blockwise]_* into core_out, and gated_delta_prefill_norm_* into out.
#include <algorithm>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void gated_delta_prefill(Context& ctx, const ModelConfig& c, const std::string& label,
                         const GatedDeltaPrefillSpans& s, size_t tokens) {
  GatedDeltaArgs a{};
  a.num_tokens = static_cast<u32>(tokens);
  a.num_k_heads = static_cast<u32>(c.gdn_k_heads);
  a.num_v_heads = static_cast<u32>(c.gdn_v_heads);
  a.head_v_dim = static_cast<u32>(c.gdn_v_dim);
  a.l2_eps = 1e-6f;
  a.norm_eps = c.eps;
  const std::string suffix = std::string(dtype_name(ctx.act)) + "_dk" + std::to_string(c.gdn_k_dim);
  const size_t channels = c.conv_dim();
  const size_t channel_groups = (channels + tuning::kGdnConvThreads - 1) / tuning::kGdnConvThreads;
  add_node(ctx, "gated_delta_conv_" + suffix, label + " conv",
           {arg_value(a), arg(s.qkv), arg(s.conv_weight->data), arg(s.conv_state), arg(s.conv_out)},
           {channel_groups, (tokens + LILY_GDN_CONV_TOKENS - 1) / LILY_GDN_CONV_TOKENS, 1},
           {tuning::kGdnConvThreads, 1, 1}, {s.qkv, s.conv_weight->data, s.conv_state}, {s.conv_out});
  // After every block of the conv has read the state it replaces (the barrier rule's write after read).
  add_node(ctx, "gated_delta_conv_state_" + suffix, label + " conv state",
           {arg_value(a), arg(s.qkv), arg(s.conv_state)}, {channel_groups, 1, 1}, {tuning::kGdnConvThreads, 1, 1},
           {s.qkv, s.conv_state}, {s.conv_state});
  // Threadgroups of kGdnPrefillRowsPerThreadgroup rows of one value head, each simdgroup keeping
  // LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP of them in registers for the whole chunk, or (REGISTER_SCAN off) for
  // LILY_GDN_SCAN_BLOCK tokens between round trips through memory.
  const size_t slice_rows = std::min(c.gdn_v_dim, tuning::kGdnPrefillRowsPerThreadgroup);
  const size_t slices = (c.gdn_v_dim + slice_rows - 1) / slice_rows;
  const size_t simdgroups =
      (slice_rows + tuning::kGdnPrefillRowsPerSimdgroup - 1) / tuning::kGdnPrefillRowsPerSimdgroup;
  const std::string variant = ctx.register_scan ? "" : "blockwise_";
  Node& scan = add_node(ctx, "gated_delta_prefill_" + variant + suffix, label,
                        {arg_value(a), arg(s.conv_out), arg(s.b), arg(s.a), arg(s.a_log->data), arg(s.dt_bias->data),
                         arg(s.recurrent_state), arg(s.core_out)},
                        {c.gdn_v_heads, slices, 1}, {32 * simdgroups, 1, 1},
                        {s.conv_out, s.b, s.a, s.a_log->data, s.dt_bias->data, s.recurrent_state},
                        {s.recurrent_state, s.core_out});
  if (!ctx.register_scan) {
    // The state is read and written once per block, not once per chunk: the traffic the ablation measures.
    const size_t extra_trips = (tokens + LILY_GDN_SCAN_BLOCK - 1) / LILY_GDN_SCAN_BLOCK - 1;
    scan.traffic_read += extra_trips * s.recurrent_state.length;
    scan.traffic_written += extra_trips * s.recurrent_state.length;
  }
  // The gated norm needs a head's whole row of o, which the scan splits over threadgroups: one simdgroup per
  // (token, value head) row.
  const size_t norm_rows = tokens * c.gdn_v_heads, rows_per_group = tuning::kGdnPrefillNormThreads / 32;
  add_node(ctx, std::string("gated_delta_prefill_norm_") + dtype_name(ctx.act), label + " norm",
           {arg_value(a), arg(s.core_out), arg(s.z), arg(s.norm_weight->data), arg(s.out)},
           {(norm_rows + rows_per_group - 1) / rows_per_group, 1, 1}, {tuning::kGdnPrefillNormThreads, 1, 1},
           {s.core_out, s.z, s.norm_weight->data}, {s.out});
}

}  // namespace lily::ops
