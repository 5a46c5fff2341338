// qmv_*, qmv_norm_*, qmv_residual_*, qmm_* (metal/qmatmul.metal): Y = X W^T with W MLX affine-quantized, group 64;
// with IN_GEMM_DEQUANT off, prefill GEMMs run dequantize (dequantize.cpp) and then mm (mm.cpp) instead of qmm_*.
#include <algorithm>
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
  // qmv and qmm read x in the activation dtype and may write f32 in bf16 mode (the _of32 variants: router and lm_head
  // logits). The dequantize + mm ablation has no f32 output: there, f32 output stays on qmv, which takes any number
  // of rows, four per threadgroup row (grid y).
  const bool f32_out = dtype == DType::F32 && ctx.act != DType::F32;
  if (tuning::mma_gemv(ctx.mma_gemv, rows, w.rows, w.bits, ctx.act == DType::BF16, w.scale_dtype == DType::BF16)) {
    add_node(ctx, std::string("qmv_mma_q4_g64_bf16") + (f32_out ? "_of32" : ""), label,
             {arg_value(a), arg(x), arg(w.data), arg(w.scales), arg(w.biases), arg(y)},
             {(w.rows + LILY_QMV_MMA_ROWS - 1) / LILY_QMV_MMA_ROWS,
              (rows + tuning::kQmvMmaMaxRows - 1) / tuning::kQmvMmaMaxRows, 1},
             {32 * tuning::qmv_mma_simdgroups(w.rows), 1, 1}, {x, w.data, w.scales, w.biases}, {y});
    return;
  }
  const bool gemm = !tuning::qmv_takes(rows, w.rows) &&
                    (!f32_out || (ctx.in_gemm_dequant && ctx.act == DType::BF16 &&
                                  w.rows >= tuning::kQmmOf32MinOutFeatures));
  std::string name = gemm ? "qmm" : "qmv";
  name += "_q" + std::to_string(w.bits) + "_g64_" + dtype_name(f32_out ? ctx.act : dtype);
  if (w.scale_dtype == DType::F32) name += "_sf32";
  if (f32_out) name += "_of32";
  Dim3 groups{(w.rows + tuning::kQmvRowsPerThreadgroup - 1) / tuning::kQmvRowsPerThreadgroup,
                   (rows + tuning::kQmvMaxRows - 1) / tuning::kQmvMaxRows, 1};  // each takes up to 4 input rows
  Dim3 threads{tuning::kQmvThreads, 1, 1};
  if (gemm && !f32_out && ctx.tensor_ops && ctx.in_gemm_dequant && dtype == DType::BF16 &&
      ctx.act == DType::BF16 && w.scale_dtype == DType::BF16) {
    // Metal 4 tensor ops (M5-class GPUs): a 32 x 64 tile per threadgroup of 4 simdgroups.
    add_node(ctx, "qmm_nax_q" + std::to_string(w.bits) + "_g64_bf16", label,
             {arg_value(a), arg(x), arg(w.data), arg(w.scales), arg(w.biases), arg(y)},
             {(w.rows + LILY_QMM_NAX_BN - 1) / LILY_QMM_NAX_BN, (rows + LILY_QMM_NAX_BM - 1) / LILY_QMM_NAX_BM, 1},
             {128, 1, 1}, {x, w.data, w.scales, w.biases}, {y});
    return;
  }
  if (gemm) {
    // With f32 output (dtype F32) qmm_tile_rows picks 16 or 32 rows: the _of32 kernels have no 64-row tiles.
    const size_t bm = tuning::qmm_tile_rows(rows, w.rows, ctx.wide_tiles, dtype == DType::BF16);
    name += "_bm" + std::to_string(bm);
    groups = {(w.rows + LILY_GEMM_BN - 1) / LILY_GEMM_BN, (rows + bm - 1) / bm, 1};
    threads = {tuning::kGemmThreads, 1, 1};
    if (!ctx.in_gemm_dequant) {
      // The ablation: the whole weight expanded into device memory first, then a dense GEMM with qmm's tiles.
      const Span dense = dequantize(ctx, label, w, ctx.dequant_scratch, dtype);
      mm(ctx, label, x, dense, y, rows, w.cols, w.rows, bm, dtype);
      return;
    }
  }
  add_node(ctx, name, label, {arg_value(a), arg(x), arg(w.data), arg(w.scales), arg(w.biases), arg(y)}, groups,
           threads, {x, w.data, w.scales, w.biases}, {y});
}

namespace {
void check_qmv_weight(const std::string& label, const WeightRef& w) {
  if (w.bits != 4 && w.bits != 8) throw std::logic_error("[graph] " + label + ": qmv needs a 4- or 8-bit weight");
}
std::string qmv_suffix(const WeightRef& w, DType act) {
  return "_q" + std::to_string(w.bits) + "_g64_" + dtype_name(act) + (w.scale_dtype == DType::F32 ? "_sf32" : "");
}
// Threadgroups of one-row GEMVs over `rows` outputs, and their threads: staged (tuning::staged_gemv) or not.
size_t qmv_groups(size_t rows, bool staged) {
  const size_t per_group = staged ? tuning::kQmvStagedRowsPerThreadgroup : tuning::kQmvRowsPerThreadgroup;
  return (rows + per_group - 1) / per_group;
}
Dim3 qmv_grid(const WeightRef& w, bool staged) { return {qmv_groups(w.rows, staged), 1, 1}; }
Dim3 qmv_threads(bool staged) { return {staged ? tuning::kQmvStagedThreads : tuning::kQmvThreads, 1, 1}; }
// The split staged GEMVs' threads: a row of simdgroups per step slot (tuning::qmv_step_slots).
Dim3 qmv_slot_threads(const Context& ctx, const WeightRef& w) {
  return {tuning::kQmvStagedThreads, tuning::qmv_step_slots(ctx.split_steps, w.cols, w.bits), 1};
}
}  // namespace

size_t qmatmul_norm(Context& ctx, const std::string& label, const Span& x, const WeightRef& norm_weight,
                    const WeightRef& w, const Span& y, float eps, DType dtype, const Span* argmax_values,
                    const Span* argmax_ids) {
  check_qmv_weight(label, w);
  if (dtype != ctx.act && dtype != DType::F32) throw std::logic_error("[graph] " + label + ": bad output dtype");
  QMatmulNormArgs a{};
  a.in_features = static_cast<u32>(w.cols);
  a.out_features = static_cast<u32>(w.rows);
  a.num_rows = 1;
  a.eps = eps;
  const bool staged = tuning::staged_gemv(ctx.staged_gemv, w.bits, w.scale_dtype == DType::BF16, w.cols, false);
  // Only the streaming (staged) GEMV keeps the argmax, and only for f32 logits (argmax_final compares f32).
  const bool argmax = staged && argmax_values && argmax_ids && dtype == DType::F32;
  std::string name = std::string(staged ? (argmax ? "qmv_norm_argmax_staged" : "qmv_norm_staged") : "qmv_norm") +
                     qmv_suffix(w, ctx.act) + (dtype != ctx.act ? "_of32" : "") +
                     (staged ? pack_loads_suffix(ctx, {&w}) : "");
  const Dim3 groups = staged ? Dim3{std::min(qmv_groups(w.rows, true), tuning::kQmvStreamGroups), 1, 1}
                             : qmv_grid(w, false);
  std::vector<NodeArg> args = {arg_value(a), arg(x), arg(norm_weight.data), arg(w.data), arg(w.scales), arg(w.biases),
                               arg(y)};
  std::vector<Span> writes = {y};
  if (argmax) {  // one (value, id) per threadgroup
    const Span values = sub(*argmax_values, 0, groups.width * 4), ids = sub(*argmax_ids, 0, groups.width * 4);
    args.insert(args.end(), {arg(values), arg(ids)});
    writes.insert(writes.end(), {values, ids});
  }
  Node& node = add_node(ctx, name, label, std::move(args), groups, qmv_threads(staged),
                        {x, norm_weight.data, w.data, w.scales, w.biases}, std::move(writes));
  if (staged) node.early_reads = {w.data, w.scales, w.biases};
  return argmax ? groups.width : 0;
}

void qmatmul_residual(Context& ctx, const std::string& label, const Span& x, const WeightRef& w,
                      const Span& residual_out) {
  check_qmv_weight(label, w);
  QMatmulArgs a{};
  a.in_features = static_cast<u32>(w.cols);
  a.out_features = static_cast<u32>(w.rows);
  a.num_rows = 1;
  const bool staged = tuning::staged_gemv(ctx.staged_gemv, w.bits, w.scale_dtype == DType::BF16, w.cols, false);
  Node& node =
      add_node(ctx,
               std::string(staged ? "qmv_residual_staged" : "qmv_residual") + qmv_suffix(w, ctx.act) +
                   (staged ? pack_loads_suffix(ctx, {&w}) : ""),
               label,
               {arg_value(a), arg(x), arg(w.data), arg(w.scales), arg(w.biases), arg(residual_out), arg(residual_out)},
               qmv_grid(w, staged), staged ? qmv_slot_threads(ctx, w) : qmv_threads(false),
               {x, w.data, w.scales, w.biases, residual_out},
               {residual_out});
  if (staged) node.early_reads = {w.data, w.scales, w.biases};
}

void qmatmul_gated_norm_residual(Context& ctx, const std::string& label, const Span& o, const Span& gate,
                                 const WeightRef& norm_weight, size_t head_dim, float eps, const WeightRef& w,
                                 const Span& residual_out) {
  const Dim3 threads = qmv_slot_threads(ctx, w);
  if (!tuning::staged_gemv(ctx.staged_gemv, w.bits, w.scale_dtype == DType::BF16, w.cols, false) || w.bits != 4 ||
      head_dim % 4 != 0 || w.cols % head_dim != 0 || w.cols / head_dim > LILY_QMV_STAGE_MAX_HEADS ||
      w.cols > 4 * LILY_QMV_STAGE_BATCH * threads.count()) {  // the staging's one round
    throw std::logic_error("[graph] " + label + ": the gated-norm GEMV needs a staged 4-bit GEMV over whole heads");
  }
  QMatmulGatedNormArgs a{};
  a.in_features = static_cast<u32>(w.cols);
  a.out_features = static_cast<u32>(w.rows);
  a.head_dim = static_cast<u32>(head_dim);
  a.eps = eps;
  Node& node = add_node(ctx, "qmv_gated_norm_residual_staged" + qmv_suffix(w, ctx.act) + pack_loads_suffix(ctx, {&w}),
                        label,
                        {arg_value(a), arg(o), arg(gate), arg(norm_weight.data), arg(w.data), arg(w.scales),
                         arg(w.biases), arg(residual_out), arg(residual_out)},
                        qmv_grid(w, true), threads,
                        {o, gate, norm_weight.data, w.data, w.scales, w.biases, residual_out}, {residual_out});
  node.early_reads = {w.data, w.scales, w.biases};
}

bool quantized_alike(const std::vector<const WeightRef*>& parts) {
  for (const WeightRef* w : parts) {
    if (w->bits != parts[0]->bits || w->cols != parts[0]->cols || w->scale_dtype != parts[0]->scale_dtype ||
        w->experts) {
      return false;
    }
  }
  return true;
}

void qmatmul_segments(Context& ctx, const std::string& label, const Span& x, const WeightRef* norm_weight,
                      const std::vector<const WeightRef*>& parts, const std::vector<std::string>& part_names,
                      const Span& y, float eps, DType dtype, const ConvEpilogue* conv) {
  if (parts.empty() || parts.size() > LILY_QMV_MAX_SEGMENTS) {
    throw std::logic_error("[graph] " + label + ": a segmented GEMV takes 1 to 4 matrices");
  }
  if (dtype != ctx.act && dtype != DType::F32) throw std::logic_error("[graph] " + label + ": bad output dtype");
  const WeightRef& first = *parts[0];
  check_qmv_weight(label, first);
  QMatmulSegmentsArgs a{};
  a.in_features = static_cast<u32>(first.cols);
  a.num_segments = static_cast<u32>(parts.size());
  a.eps = eps;
  std::vector<NodeArg> args{arg_value(a), arg(x), arg(norm_weight ? norm_weight->data : x)};
  std::vector<Span> reads{x}, weights;
  if (norm_weight) reads.push_back(norm_weight->data);
  // Staged: 4-bit with the activation dtype out, or 8-bit with f32 out in bf16 mode (the router | shared-expert gate).
  const bool of32 = dtype != ctx.act;
  const bool staged = norm_weight && (first.bits == 4) != of32 &&
                      tuning::staged_gemv(ctx.staged_gemv, first.bits, first.scale_dtype == DType::BF16, first.cols,
                                          ctx.act == DType::BF16);
  size_t groups = 0;
  for (size_t s = 0; s < LILY_QMV_MAX_SEGMENTS; ++s) {
    // Unused segments bind the first matrix again: the kernel never reads them.
    const WeightRef& w = *parts[s < parts.size() ? s : 0];
    if (s < parts.size()) {
      // One kernel instance reads every segment: they must be quantized alike.
      if (!quantized_alike({&first, &w})) {
        throw std::logic_error("[graph] " + part_names[s] + " cannot share a GEMV with " + part_names[0] +
                               ": the matrices must be quantized alike (bits, input features, scale dtype)");
      }
      a.rows[s] = static_cast<u32>(w.rows);
      a.out_features += static_cast<u32>(w.rows);
      groups += qmv_groups(w.rows, staged);  // each segment's rows padded to whole threadgroups
      weights.insert(weights.end(), {w.data, w.scales, w.biases});
    }
    args.insert(args.end(), {arg(w.data), arg(w.scales), arg(w.biases)});
  }
  reads.insert(reads.end(), weights.begin(), weights.end());
  args[0] = arg_value(a);
  args.push_back(arg(y));
  std::string name = std::string(norm_weight ? (staged ? "qmv_norm_seg_staged" : "qmv_norm_seg") : "qmv_seg") +
                     qmv_suffix(first, ctx.act) + (of32 ? "_of32" : "") + (staged ? pack_loads_suffix(ctx, parts) : "");
  std::vector<Span> writes{y};
  if (conv) {
    if (!staged || first.bits != 4 || of32 || parts.size() < 2) {
      throw std::logic_error("[graph] " + label + ": the conv epilogue needs the staged 4-bit normed GEMV");
    }
    name = "qmv_norm_seg_conv_staged" + qmv_suffix(first, ctx.act) + pack_loads_suffix(ctx, parts);
    args.insert(args.end(), {arg(conv->weight->data), arg(conv->state), arg(conv->out), arg(conv->gate)});
    reads.insert(reads.end(), {conv->weight->data, conv->state});
    writes.insert(writes.end(), {conv->state, conv->out, conv->gate});
  }
  // The conv kernel streams its blocks over the threadgroups that fit at once (tuning::kQmvConvStreamGroups); the
  // other takes one per block unless the test option seg_stream_groups caps them.
  const size_t cap = conv ? tuning::kQmvConvStreamGroups : ctx.seg_stream_groups;
  if (staged && cap) groups = std::min(groups, cap);
  // The staged segmented GEMV splits its steps as the residual ones do (the router's 8-bit K = 2048: two); the conv
  // one takes one step at the model's K and stays 1-D.
  const Dim3 threads = staged && !conv ? qmv_slot_threads(ctx, first) : qmv_threads(staged);
  Node& node = add_node(ctx, name, label, args, {groups, 1, 1}, threads, reads, writes);
  if (staged) node.early_reads = weights;
  if (conv) node.early_reads.insert(node.early_reads.end(), {conv->weight->data, conv->state});
}

}  // namespace lily::ops
