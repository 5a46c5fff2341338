// Qwen3.5/3.6-35B-A3B (qwen3_5_moe) as the engine runs it, written once: its tensors, its buffers and the forward
// pass of T tokens, T = 1 included (see model.h). The maths is python/lily/reference.py's; each op picks its kernels
// by the row count (src/lily_ext/ops/).
#include <algorithm>
#include <stdexcept>

#include "../../../metal/lily.h"
#include "../model.h"
#include "../ops/ops.h"
#include "../tuning.h"

namespace lily {

namespace {

std::string layer_prefix(size_t i) { return "layers." + std::to_string(i) + "."; }

Span whole(const Graph& g, int buffer) { return Span{buffer, 0, g.buffers.at(buffer).length}; }

const WeightRef& weight(const WeightTable& w, const std::string& name) {
  auto found = w.find(name);
  if (found == w.end()) throw Error("[engine] the checkpoint has no tensor " + name);
  return found->second;
}

// A synthetic tensor: its name and reference, the reference's spans sized but not yet placed in a buffer.
struct PendingWeight {
  std::string name;
  WeightRef ref;
};

// Lays the tensors out back to back (16-byte aligned) in one virtual buffer, as a checkpoint file would hold them.
WeightTable place_in_one_buffer(std::vector<PendingWeight>& pending, Graph& graph) {
  WeightTable table;
  auto place = [](Span& s, size_t& cursor, int buffer) {
    s.buffer = buffer;
    s.offset = cursor;
    cursor += (s.length + 15) / 16 * 16;
  };
  int file = graph.add_buffer("weights", 16, BufferRole::Weights);
  size_t cursor = 0;
  for (PendingWeight& p : pending) {
    place(p.ref.data, cursor, file);
    if (p.ref.bits) {
      place(p.ref.scales, cursor, file);
      place(p.ref.biases, cursor, file);
    }
    table[p.name] = p.ref;
  }
  graph.buffers[file].length = cursor;
  return table;
}

}  // namespace

// ---- the tensors ----

WeightTable synthetic_weights(const ModelConfig& c, Graph& graph) {
  std::vector<PendingWeight> pending;
  auto quantized = [&](const std::string& name, size_t experts, size_t rows, size_t cols, int bits) {
    WeightRef w;
    w.bits = bits;
    w.dtype = DType::U32;
    w.experts = experts;
    w.rows = rows;
    w.cols = cols;
    size_t n = std::max<size_t>(experts, 1) * rows;
    w.data.length = n * cols * bits / 8;
    w.scales.length = w.biases.length = n * (cols / 64) * 2;
    pending.push_back({name, w});
  };
  auto dense = [&](const std::string& name, size_t rows, size_t cols, DType dtype) {
    WeightRef w;
    w.dtype = dtype;
    w.rows = rows;
    w.cols = cols;
    w.data.length = rows * cols * dtype_size(dtype);
    pending.push_back({name, w});
  };
  const size_t H = c.hidden_size;
  quantized("embed_tokens.weight", 0, c.vocab_size, H, 4);
  quantized("lm_head.weight", 0, c.vocab_size, H, 4);
  dense("norm.weight", 1, H, DType::BF16);
  for (size_t i = 0; i < c.num_layers(); ++i) {
    std::string p = layer_prefix(i);
    dense(p + "input_layernorm.weight", 1, H, DType::BF16);
    dense(p + "post_attention_layernorm.weight", 1, H, DType::BF16);
    if (c.attention_layers[i]) {
      quantized(p + "self_attn.q_proj.weight", 0, 2 * c.num_heads * c.head_dim, H, 4);
      quantized(p + "self_attn.k_proj.weight", 0, c.num_kv_heads * c.head_dim, H, 4);
      quantized(p + "self_attn.v_proj.weight", 0, c.num_kv_heads * c.head_dim, H, 4);
      quantized(p + "self_attn.o_proj.weight", 0, H, c.num_heads * c.head_dim, 4);
      dense(p + "self_attn.q_norm.weight", 1, c.head_dim, DType::BF16);
      dense(p + "self_attn.k_norm.weight", 1, c.head_dim, DType::BF16);
    } else {
      const size_t vd = c.gdn_v_heads * c.gdn_v_dim;
      quantized(p + "linear_attn.in_proj_qkv.weight", 0, c.conv_dim(), H, 4);
      quantized(p + "linear_attn.in_proj_z.weight", 0, vd, H, 4);
      quantized(p + "linear_attn.in_proj_b.weight", 0, c.gdn_v_heads, H, 4);
      quantized(p + "linear_attn.in_proj_a.weight", 0, c.gdn_v_heads, H, 4);
      quantized(p + "linear_attn.out_proj.weight", 0, H, vd, 4);
      dense(p + "linear_attn.conv1d.weight", c.conv_dim(), c.conv_kernel, DType::BF16);
      dense(p + "linear_attn.dt_bias", 1, c.gdn_v_heads, DType::F32);
      dense(p + "linear_attn.A_log", 1, c.gdn_v_heads, DType::F32);
      dense(p + "linear_attn.norm.weight", 1, c.gdn_v_dim, DType::BF16);
    }
    quantized(p + "mlp.gate.weight", 0, c.num_experts, H, 8);
    quantized(p + "mlp.shared_expert_gate.weight", 0, 1, H, 8);
    quantized(p + "mlp.switch_mlp.gate_proj.weight", c.num_experts, c.expert_size, H, 4);
    quantized(p + "mlp.switch_mlp.up_proj.weight", c.num_experts, c.expert_size, H, 4);
    quantized(p + "mlp.switch_mlp.down_proj.weight", c.num_experts, H, c.expert_size, 4);
    quantized(p + "mlp.shared_expert.gate_proj.weight", 0, c.shared_expert_size, H, 4);
    quantized(p + "mlp.shared_expert.up_proj.weight", 0, c.shared_expert_size, H, 4);
    quantized(p + "mlp.shared_expert.down_proj.weight", 0, H, c.shared_expert_size, 4);
  }
  return place_in_one_buffer(pending, graph);
}

// ---- the buffers ----

StateLayout state_layout(const ModelConfig& c, Precision precision) {
  const size_t act = precision == Precision::Float32 ? 4 : 2;
  StateLayout s;
  s.conv_bytes = (c.conv_kernel - 1) * c.conv_dim() * act;
  s.recurrent_bytes = c.gdn_v_heads * c.gdn_v_dim * c.gdn_k_dim * 4;
  s.kv_bytes_per_row = c.num_kv_heads * c.head_dim * act;
  return s;
}

StateBuffers add_state_buffers(const ModelConfig& c, Precision precision, size_t kv_capacity, Graph& g) {
  // argmax_partial's partials, the lm_head's when it keeps them (one per streaming threadgroup: FUSED_ARGMAX), or
  // the sampler's scratch.
  const size_t choice_words = std::max({(c.vocab_size + LILY_ARGMAX_BLOCK - 1) / LILY_ARGMAX_BLOCK,
                                        tuning::kQmvStreamGroups, ops::sample_scratch_words(c.vocab_size)});
  StateBuffers b;
  b.kv_capacity = kv_capacity;
  b.tokens = g.add_buffer("tokens", 2 * 4, BufferRole::Io);
  // lily.sampling steps 1-3 on the GPU (penalized requests only): host-written bias and seen-token tables, the
  // counts count_token keeps, and the processed fp32 logits the choice then reads.
  b.logit_bias = g.add_buffer("logit bias", c.vocab_size * 4, BufferRole::Io);
  b.seen_tokens = g.add_buffer("seen tokens", c.vocab_size * 4, BufferRole::Io);
  b.token_counts = g.add_buffer("token counts", c.vocab_size * 4, BufferRole::Io);
  b.penalized_logits = g.add_buffer("penalized logits", c.vocab_size * 4, BufferRole::Scratch);
  b.choice_values = g.add_buffer("choice values", choice_words * 4, BufferRole::Scratch);
  b.choice_ids = g.add_buffer("choice ids", choice_words * 4, BufferRole::Scratch);
  StateLayout s = state_layout(c, precision);
  for (size_t i = 0; i < c.num_layers(); ++i) {
    std::string p = layer_prefix(i);
    bool attn = c.attention_layers[i];
    b.conv_state.push_back(attn ? -1 : g.add_buffer(p + "conv state", s.conv_bytes, BufferRole::State));
    b.recurrent_state.push_back(attn ? -1 : g.add_buffer(p + "recurrent state", s.recurrent_bytes, BufferRole::State));
    b.k_cache.push_back(attn ? g.add_buffer(p + "k cache", s.kv_bytes_per_row * kv_capacity, BufferRole::State) : -1);
    b.v_cache.push_back(attn ? g.add_buffer(p + "v cache", s.kv_bytes_per_row * kv_capacity, BufferRole::State) : -1);
  }
  return b;
}

PassBuffers add_pass_buffers(const ModelConfig& c, Precision precision, size_t rows, size_t logit_rows,
                             size_t max_keys, const std::string& name, Graph& g) {
  const size_t a = precision == Precision::Float32 ? 4 : 2, T = rows, H = c.hidden_size;
  const size_t vd = c.gdn_v_heads * c.gdn_v_dim, heads = c.num_heads * c.head_dim, pairs = T * c.top_k;
  const size_t gdn_projections = c.conv_dim() + vd + 2 * c.gdn_v_heads;
  const size_t attention_projections = (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  // Split-KV partials for the most blocks any split_kv_min_keys (>= 1) picks up to max_keys.
  const size_t max_blocks = std::max<size_t>(1, tuning::attention_split_blocks(max_keys, 1, 1));
  auto add = [&](const char* what, size_t bytes, BufferRole role) {
    return g.add_buffer(name.empty() ? what : name + " " + what, bytes, role);
  };
  auto scratch = [&](const char* what, size_t bytes) { return add(what, bytes, BufferRole::Scratch); };
  PassBuffers p;
  p.rows = T;
  p.logit_rows = std::max<size_t>(logit_rows, 1);
  p.hidden = scratch("hidden", T * H * a);
  p.normed = scratch("normed", T * H * a);
  p.mixer_out = scratch("mixer out", T * H * a);
  p.projections = scratch("projections", T * std::max(gdn_projections, attention_projections) * a);
  p.gdn_out = scratch("deltanet out", T * vd * a);
  p.q = scratch("q", T * heads * a);
  p.gate = scratch("gate", T * heads * a);
  p.attn_out = scratch("attention out", T * heads * a);
  // Per query head: the decode step's blocks, or a split prefill chunk's (token, block) pairs.
  const size_t partial_rows = std::max(max_blocks, ops::attention_prefill_split_rows(c, T));
  p.attn_partial_out = scratch("attention partials", c.num_heads * partial_rows * c.head_dim * 4);
  p.attn_partial_stats = scratch("attention stats", c.num_heads * partial_rows * 2 * 4);
  p.router = scratch("router logits", T * (c.num_experts + 1) * 4);
  p.expert_ids = scratch("expert ids", pairs * 4);
  p.expert_weights = scratch("expert weights", pairs * 4);
  // One row: the decode kernels' f32 hidden of the k experts and the shared one; more: the routed rows'.
  p.moe_hidden = scratch("moe hidden", std::max((c.top_k * c.expert_size + c.shared_expert_size) * 4,
                                                T > 1 ? pairs * c.expert_size * a : 0));
  // f32 in every precision; [V] f32 per row (1 MB at full size), so only the rows asked for.
  p.logits = add("logits", p.logit_rows * c.vocab_size * 4, BufferRole::Io);
  p.ids = add("ids", T * 4, BufferRole::Io);
  // f32 DeltaNet conv and scan outputs: the prefill kernels', and one row's for the spread decode step, which also
  // takes SiLU(z) of one row (a one-row pass on any pass's buffers: the last chunk of a prompt).
  p.conv_out = scratch("conv out", T * c.conv_dim() * 4);
  p.core_out = scratch("deltanet core out", T * vd * 4);
  p.gdn_gate = scratch("deltanet gate", vd * 4);
  p.block_counts = p.expert_offsets = p.tile_map = p.tile_count = p.sorted_pairs = p.expert_out = p.shared_pairs =
      p.shared_tile_map = p.shared_tile_count = p.ones = p.shared_hidden = p.shared_out = -1;
  if (T == 1) return p;  // what only the T-row kernels use
  const size_t blocks = (pairs + LILY_MOE_SORT_BLOCK - 1) / LILY_MOE_SORT_BLOCK;
  p.block_counts = scratch("block counts", blocks * c.num_experts * 4);
  p.expert_offsets = scratch("expert offsets", (c.num_experts + 1) * 4);
  p.tile_map = scratch("tile map", ops::moe_max_tiles(pairs, c.num_experts, 16) * 16);
  p.tile_count = scratch("tile count", 4);
  p.sorted_pairs = scratch("sorted pairs", pairs * 4);
  p.expert_out = scratch("expert out", pairs * H * a);
  p.shared_pairs = add("shared pairs", T * 4, BufferRole::Io);
  p.shared_tile_map = add("shared tile map", (T + 15) / 16 * 16, BufferRole::Io);
  p.shared_tile_count = add("shared tile count", 4, BufferRole::Io);
  p.ones = add("ones", T * 4, BufferRole::Io);
  p.shared_hidden = scratch("shared hidden", T * c.shared_expert_size * a);
  p.shared_out = scratch("shared out", T * H * a);
  return p;
}

int add_dequant_scratch(Precision precision, const WeightTable& weights, Graph& g) {
  const size_t a = precision == Precision::Float32 ? 4 : 2;
  size_t largest = 0;
  for (const auto& [name, w] : weights) {
    if (w.bits != 0 && w.experts == 0) largest = std::max(largest, w.rows * w.cols);
  }
  return g.add_buffer("prefill dequantized weight", std::max<size_t>(largest * a, 4), BufferRole::Scratch);
}

int add_gdn_chunk_scratch(const ModelConfig& c, size_t rows, Graph& g) {
  const size_t bytes = ops::gated_delta_chunk_scratch_bytes(c, rows);
  return bytes != 0 ? g.add_buffer("prefill deltanet chunks", bytes, BufferRole::Scratch) : -1;
}

SharedExpertRouting shared_expert_routing(size_t tokens, bool wide_tiles) {
  SharedExpertRouting r;
  const size_t bm = ops::moe_tile_rows(static_cast<double>(tokens), wide_tiles);
  for (size_t i = 0; i < tokens; ++i) r.pairs.push_back(static_cast<uint32_t>(i));
  r.ones.assign(tokens, 1.0f);
  for (size_t first = 0; first < tokens; first += bm) {
    r.tile_map.insert(r.tile_map.end(), {0u, static_cast<uint32_t>(first),
                                         static_cast<uint32_t>(std::min(bm, tokens - first)), 0u});
  }
  r.tile_count = static_cast<uint32_t>(r.tile_map.size() / 4);
  return r;
}

// ---- the forward pass ----

namespace {

// One forward pass under construction: what its dispatches share (configuration, switches, weights, state, the
// pass's scratch, the op context and the hidden-stream rows), and the pieces build_forward puts together, one method
// each.
struct Forward {
  const ModelConfig& c;
  const Switches& sw;
  const WeightTable& w;
  const StateBuffers& state;
  const PassBuffers& p;
  Graph& g;
  size_t position, T;
  DType act;
  size_t a, H;
  ops::Context ctx;
  // One row with FUSION on: every RMSNorm of the hidden stream is folded into the GEMV(s) reading it (qmv_norm: each
  // simdgroup recomputes the row's sum of squares), the residual adds into the out/o projection (qmv_residual), and
  // moe_route with the post-attention norm into the experts' gate/up kernel: 6 dispatches per DeltaNet layer, 7 per
  // attention layer (short context), each depending on the one before.
  bool fuse;
  Span hidden, normed, mixer_out;

  Forward(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
          const StateBuffers& state, const PassBuffers& p, size_t position, size_t T, Graph& g)
      : c(c), sw(sw), w(w), state(state), p(p), g(g), position(position), T(T),
        act(precision == Precision::Float32 ? DType::F32 : DType::BF16), a(dtype_size(act)), H(c.hidden_size),
        ctx{g, act, !sw.concurrent, sw.wide_tiles}, fuse(sw.fusion && T == 1), hidden(rows(p.hidden, H * a)),
        normed(rows(p.normed, H * a)), mixer_out(rows(p.mixer_out, H * a)) {
    if (T > p.rows) throw std::logic_error("[graph] a pass of more rows than its buffers hold");
    ctx.gqa_packing = sw.gqa_packing;
    ctx.coalesced_kv = sw.coalesced_kv;
    ctx.staged_gemv = sw.staged_gemv;
    ctx.mma_gemv = sw.mma_gemv;
    ctx.spread_deltanet_step = sw.spread_deltanet_step && fuse && sw.fused_projections;
    ctx.whole_pack_loads = sw.whole_pack_loads;
    ctx.gpu_routing = sw.gpu_routing;
    ctx.in_gemm_dequant = sw.in_gemm_dequant;
    if (p.dequant >= 0) ctx.dequant_scratch = whole(g, p.dequant);
    ctx.register_scan = sw.register_scan;
    ctx.chunked_scan = sw.chunked_scan;
    if (p.gdn_chunks >= 0) ctx.gdn_chunks = whole(g, p.gdn_chunks);
    ctx.tensor_ops = sw.tensor_ops;
    ctx.mma_attention = sw.mma_attention;
    ctx.fused_attention_prep = sw.fused_attention_prep;
    ctx.early_moe_down = sw.early_moe_down;
    ctx.split_steps = sw.split_steps;
    ctx.seg_stream_groups = sw.seg_stream_groups;
  }

  // The pass's T rows of `buffer`, `row_bytes` each.
  Span rows(int buffer, size_t row_bytes) const { return Span{buffer, 0, T * row_bytes}; }

  // `norm` (rms_norm(x) ⊙ norm, written to `normed`) in front of the GEMVs that read it: its own dispatch, or folded.
  Span normalise(const std::string& label, const WeightRef& norm) {
    if (fuse) return hidden;
    ops::rms_norm(ctx, label, hidden, norm, normed, T, H, c.eps);
    return normed;
  }

  void matmul(const std::string& label, const Span& x, const WeightRef& m, const Span& out, DType dtype,
              const WeightRef& norm) {
    if (fuse) {
      ops::qmatmul_norm(ctx, label, x, norm, m, out, c.eps, dtype);
    } else {
      ops::qmatmul(ctx, label, x, m, out, T, dtype);
    }
  }

  // The weights named prefix + part + ".weight", in order.
  std::vector<const WeightRef*> weights(const std::string& prefix, const std::vector<std::string>& parts) const {
    std::vector<const WeightRef*> refs;
    for (const std::string& part : parts) refs.push_back(&weight(w, prefix + part + ".weight"));
    return refs;
  }

  // The projections of x by the matrices `parts` (named after `prefix`), each matrix's T output rows a block of `out`
  // after the previous one's. One row with FUSED_PROJECTIONS on: one segmented GEMV reading each matrix's own
  // (mapped) bytes (with `conv`, the DeltaNet conv folded into its first segment); else one GEMV or GEMM per matrix.
  void projections(const std::string& label, const std::string& prefix, const std::vector<std::string>& parts,
                   const Span& x, const Span& out, DType dtype, const WeightRef& norm,
                   const ops::ConvEpilogue* conv = nullptr) {
    std::vector<std::string> names;
    for (const std::string& part : parts) names.push_back(prefix + part + ".weight");
    const std::vector<const WeightRef*> refs = weights(prefix, parts);
    size_t rows = 0;
    for (const WeightRef* ref : refs) rows += ref->rows;
    // Matrices quantized differently (a mixed-bit checkpoint) cannot share one kernel: one GEMV each, below.
    if (T == 1 && sw.fused_projections && ops::quantized_alike(refs)) {
      ops::qmatmul_segments(ctx, label, x, fuse ? &norm : nullptr, refs, names,
                            ops::sub(out, 0, rows * dtype_size(dtype)), c.eps, dtype, conv);
      return;
    }
    if (conv) throw std::logic_error("[graph] " + label + ": the conv epilogue needs the segmented GEMV");
    size_t offset = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const size_t bytes = T * refs[i]->rows * dtype_size(dtype);
      matmul(prefix + parts[i], x, *refs[i], ops::sub(out, offset, bytes), dtype, norm);
      offset += bytes;
    }
  }

  // The out/o projection: hidden += W · x in one GEMV, or into mixer_out (the residual add comes with the next norm).
  void out_projection(const std::string& label, const Span& x, const WeightRef& m) {
    if (fuse) {
      ops::qmatmul_residual(ctx, label, x, m, hidden);
    } else {
      ops::qmatmul(ctx, label, x, m, mixer_out, T, act);
    }
  }

  // Layer i's mixer when it is full attention: q (with its gate), k and v projected, attention over the cache (one
  // token: split over key blocks once the context is long enough), then o_proj.
  void attention_mixer(size_t i, const std::string& pre, const Span& mixer_in, const WeightRef& input_norm) {
    const std::string s = pre + "self_attn.";
    const size_t qg = T * 2 * c.num_heads * c.head_dim * a, kv = T * c.num_kv_heads * c.head_dim * a;
    const Span proj = whole(g, p.projections);
    projections(s + "in_proj", s, {"q_proj", "k_proj", "v_proj"}, mixer_in, proj, act, input_norm);
    ops::AttentionSpans at;
    at.q_and_gate = ops::sub(proj, 0, qg);
    at.k = ops::sub(proj, qg, kv);
    at.v = ops::sub(proj, qg + kv, kv);
    at.q = rows(p.q, c.num_heads * c.head_dim * a);
    at.gate = rows(p.gate, c.num_heads * c.head_dim * a);
    at.out = rows(p.attn_out, c.num_heads * c.head_dim * a);
    at.k_cache = whole(g, state.k_cache[i]);
    at.v_cache = whole(g, state.v_cache[i]);
    at.partial_out = whole(g, p.attn_partial_out);
    at.partial_stats = whole(g, p.attn_partial_stats);
    at.q_norm = &weight(w, s + "q_norm.weight");
    at.k_norm = &weight(w, s + "k_norm.weight");
    at.capacity = state.kv_capacity;
    const size_t split_blocks = T == 1 ? ops::attention_split_blocks(sw, position + 1)
                                       : ops::attention_prefill_split_blocks(sw, c, T, position + T);
    ops::attention(ctx, c, pre + "attention", at, position, T, split_blocks);
    out_projection(s + "o_proj", at.out, weight(w, s + "o_proj.weight"));
  }

  // Layer i's mixer when it is a Gated DeltaNet: qkv, z, b and a projected, the conv and the recurrence (their states
  // in place), then out_proj. A decode token spread over many threadgroups (ops::spread_deltanet_step) runs the conv
  // in the projection's GEMV, the recurrence on the prefill scan and the gated norm in out_proj's GEMV.
  void deltanet_mixer(size_t i, const std::string& pre, const Span& mixer_in, const WeightRef& input_norm) {
    const std::string s = pre + "linear_attn.";
    const size_t C = T * c.conv_dim() * a, vd = T * c.gdn_v_heads * c.gdn_v_dim * a, hv = T * c.gdn_v_heads * a;
    const Span proj = whole(g, p.projections);
    const std::vector<std::string> in_proj{"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"};
    const WeightRef& out_proj = weight(w, s + "out_proj.weight");
    ops::GatedDeltaSpans gd;
    gd.qkv = ops::sub(proj, 0, C);
    gd.z = ops::sub(proj, C, vd);
    gd.b = ops::sub(proj, C + vd, hv);
    gd.a = ops::sub(proj, C + vd + hv, hv);
    gd.conv_out = rows(p.conv_out, c.conv_dim() * 4);
    gd.core_out = rows(p.core_out, c.gdn_v_heads * c.gdn_v_dim * 4);
    gd.out = rows(p.gdn_out, c.gdn_v_heads * c.gdn_v_dim * a);
    gd.conv_state = whole(g, state.conv_state[i]);
    gd.recurrent_state = whole(g, state.recurrent_state[i]);
    gd.conv_weight = &weight(w, s + "conv1d.weight");
    gd.a_log = &weight(w, s + "A_log");
    gd.dt_bias = &weight(w, s + "dt_bias");
    gd.norm_weight = &weight(w, s + "norm.weight");
    if (ops::spread_deltanet_step(ctx, c, weights(s, in_proj), out_proj)) {
      const ops::ConvEpilogue conv{gd.conv_weight, gd.conv_state, gd.conv_out, whole(g, p.gdn_gate)};
      projections(s + "in_proj", s, in_proj, mixer_in, proj, act, input_norm, &conv);
      ops::gated_delta_scan(ctx, c, pre + "deltanet", gd, T);
      ops::qmatmul_gated_norm_residual(ctx, s + "out_proj", gd.core_out, conv.gate, *gd.norm_weight, c.gdn_v_dim,
                                       c.eps, out_proj, hidden);
      return;
    }
    projections(s + "in_proj", s, in_proj, mixer_in, proj, act, input_norm);
    ops::gated_delta(ctx, c, pre + "deltanet", gd, T);
    out_projection(s + "out_proj", gd.out, out_proj);
  }

  // The layer's MoE block after its mixer: the residual add and post-attention norm (unless folded), the router and
  // shared-expert gate logits (f32), then the routed and shared experts adding into the hidden stream.
  void moe_block(const std::string& pre) {
    const WeightRef& post_norm = weight(w, pre + "post_attention_layernorm.weight");
    if (!fuse) {
      // hidden += mixer out (in place), normed = post_attention_layernorm(hidden).
      ops::rms_norm_residual(ctx, pre + "post_attention_layernorm", mixer_out, hidden, post_norm, normed, hidden, T,
                             H, c.eps);
    }
    const std::string m = pre + "mlp.";
    ops::MoeSpans mo;
    mo.x = fuse ? hidden : normed;
    mo.router = rows(p.router, (c.num_experts + 1) * 4);
    projections(m + "router", m, {"gate", "shared_expert_gate"}, mo.x, mo.router, DType::F32, post_norm);
    mo.expert_ids = whole(g, p.expert_ids);
    mo.expert_weights = whole(g, p.expert_weights);
    mo.hidden = whole(g, p.moe_hidden);
    mo.residual_out = hidden;
    if (T > 1) {
      mo.block_counts = whole(g, p.block_counts);
      mo.expert_offsets = whole(g, p.expert_offsets);
      mo.tile_map = whole(g, p.tile_map);
      mo.tile_count = whole(g, p.tile_count);
      mo.sorted_pairs = whole(g, p.sorted_pairs);
      mo.expert_out = whole(g, p.expert_out);
      mo.shared_pairs = whole(g, p.shared_pairs);
      mo.shared_tile_map = whole(g, p.shared_tile_map);
      mo.shared_tile_count = whole(g, p.shared_tile_count);
      mo.ones = whole(g, p.ones);
      mo.shared_hidden = whole(g, p.shared_hidden);
      mo.shared_out = whole(g, p.shared_out);
    }
    mo.gate = &weight(w, m + "switch_mlp.gate_proj.weight");
    mo.up = &weight(w, m + "switch_mlp.up_proj.weight");
    mo.down = &weight(w, m + "switch_mlp.down_proj.weight");
    mo.shared_gate = &weight(w, m + "shared_expert.gate_proj.weight");
    mo.shared_up = &weight(w, m + "shared_expert.up_proj.weight");
    mo.shared_down = &weight(w, m + "shared_expert.down_proj.weight");
    ops::moe(ctx, c, pre + "moe", mo, T, fuse ? &post_norm : nullptr, c.eps);
  }

  // The final norm and lm_head of the last `logit_rows` rows, f32 logits in every precision: rounded to bf16 (8 bits
  // of mantissa), near-equal logits tie and the argmax picks between them by index. Returns the argmax partials the
  // lm_head wrote to the input's argmax spans (one fused row only; 0: none).
  size_t logits(size_t logit_rows, const PassInput& in) {
    if (logit_rows > T || logit_rows > p.logit_rows) {
      throw std::logic_error("[graph] more logit rows than the pass or its logits buffer has");
    }
    const WeightRef& final_norm = weight(w, "norm.weight");
    const WeightRef& lm_head = weight(w, "lm_head.weight");
    const Span out{p.logits, 0, logit_rows * c.vocab_size * 4};
    const Span last = ops::sub(hidden, (T - logit_rows) * H * a, logit_rows * H * a);
    if (fuse) {
      const bool keeps_argmax = logit_rows == 1 && in.argmax_values.length > 0;
      return ops::qmatmul_norm(ctx, "lm_head", last, final_norm, lm_head, out, c.eps, DType::F32,
                               keeps_argmax ? &in.argmax_values : nullptr, keeps_argmax ? &in.argmax_ids : nullptr);
    }
    const Span last_normed = ops::sub(normed, 0, logit_rows * H * a);
    ops::rms_norm(ctx, "norm", last, final_norm, last_normed, logit_rows, H, c.eps);
    ops::qmatmul(ctx, "lm_head", last_normed, lm_head, out, logit_rows, DType::F32);
    return 0;
  }
};

}  // namespace

size_t build_forward(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
                     const StateBuffers& state, const PassBuffers& pass, const PassInput& in, Graph& g) {
  Forward f(c, precision, sw, w, state, pass, in.position, in.tokens, g);
  ops::embedding(f.ctx, in.ids, in.ids_offset, weight(w, "embed_tokens.weight"), f.hidden, in.tokens);
  for (size_t i = 0; i < c.num_layers(); ++i) {
    const std::string pre = layer_prefix(i);
    const WeightRef& input_norm = weight(w, pre + "input_layernorm.weight");
    const Span mixer_in = f.normalise(pre + "input_layernorm", input_norm);
    if (c.attention_layers[i]) {
      f.attention_mixer(i, pre, mixer_in, input_norm);
    } else {
      f.deltanet_mixer(i, pre, mixer_in, input_norm);
    }
    f.moe_block(pre);
  }
  return in.logit_rows ? f.logits(in.logit_rows, in) : 0;
}

void build_decode_step(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
                       const StateBuffers& state, const PassBuffers& step, size_t position, int token_slot,
                       int next_slot, Graph& g, const std::optional<TokenChoice>& choice) {
  PassInput in;
  in.position = position;
  in.ids = whole(g, state.tokens);
  in.ids_offset = static_cast<size_t>(token_slot);
  // FUSED_ARGMAX: a greedy choice from the logits as they are (no penalties) can take the lm_head's own partials.
  if (sw.gpu_token && choice && sw.fused_argmax && choice->temperature == 0.0f && !choice->penalized()) {
    in.argmax_values = whole(g, state.choice_values);
    in.argmax_ids = whole(g, state.choice_ids);
  }
  const size_t argmax_partials = build_forward(c, precision, sw, w, state, step, in, g);
  if (sw.gpu_token && choice) {
    // The token at position + 1.
    build_token_choice(c, *choice, state, whole(g, step.logits), position, 1, next_slot, g, argmax_partials);
  }
}

void build_token_choice(const ModelConfig& c, const TokenChoice& choice, const StateBuffers& state,
                        const Span& logits, size_t position, int position_delta, int out_slot, Graph& g,
                        size_t argmax_partials) {
  // The logits are f32 in every precision, and so is every kernel of the choice.
  ops::Context ctx{g, DType::F32, false};
  Span chosen_from = logits;
  const Span tokens = whole(g, state.tokens), seen = whole(g, state.seen_tokens), counts = whole(g, state.token_counts);
  const Span values = whole(g, state.choice_values), ids = whole(g, state.choice_ids);
  if (choice.penalized()) {
    chosen_from = whole(g, state.penalized_logits);
    ops::penalize_logits(ctx, logits, c.vocab_size, choice, whole(g, state.logit_bias), seen, counts, chosen_from);
  }
  if (choice.temperature == 0.0f && argmax_partials) {
    ops::argmax_final(ctx, c.vocab_size, values, ids, argmax_partials, tokens, static_cast<size_t>(out_slot));
  } else if (choice.temperature == 0.0f) {
    ops::argmax(ctx, chosen_from, c.vocab_size, values, ids, tokens, static_cast<size_t>(out_slot));
  } else {
    ops::sample(ctx, chosen_from, c.vocab_size, choice, values, ids, tokens, static_cast<size_t>(out_slot), position,
                position_delta);
  }
  if (choice.penalized()) ops::count_token(ctx, c.vocab_size, tokens, static_cast<size_t>(out_slot), seen, counts);
}

}  // namespace lily
