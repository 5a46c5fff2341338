// Weights, state buffers and the decode graph (see model.h).
#include "model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "../../metal/lily.h"
#include "encoder.h"
#include "layout_probe.h"
#include "ops/ops.h"
#include "plan.h"
#include "tuning.h"

namespace lily {

namespace {

std::string layer_prefix(size_t i) { return "layers." + std::to_string(i) + "."; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

[[noreturn]] void bad_config(const std::string& field, const std::string& why) {
  throw mtl::Error("[engine] config field " + field + ": " + why);
}

}  // namespace

void ModelConfig::validate() const {
  auto positive = [](size_t v, const char* field) {
    if (v == 0) bad_config(field, "must be positive");
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_layers(), "layer_types");
  positive(num_experts, "num_experts");
  positive(top_k, "num_experts_per_tok");
  if (hidden_size % 64) bad_config("hidden_size", "must be a multiple of 64 (quantization group)");
  if (num_experts > LILY_MOE_MAX_EXPERTS) bad_config("num_experts", "at most " + std::to_string(LILY_MOE_MAX_EXPERTS));
  if (top_k > num_experts) bad_config("num_experts_per_tok", "at most num_experts");
  if (expert_size % 64 || shared_expert_size % 64) bad_config("moe_intermediate_size", "must be multiples of 64");
  if (gdn_k_heads == 0 || gdn_v_heads % gdn_k_heads) bad_config("linear_num_value_heads", "must be a multiple of linear_num_key_heads");
  if (num_kv_heads == 0 || num_heads % num_kv_heads) bad_config("num_attention_heads", "must be a multiple of num_key_value_heads");
}

void ModelConfig::check_kernel_shapes() const {
  bool any_attention = std::find(attention_layers.begin(), attention_layers.end(), true) != attention_layers.end();
  bool any_gdn = std::find(attention_layers.begin(), attention_layers.end(), false) != attention_layers.end();
  if (any_attention) ops::check_attention_shapes(*this);  // head dims 256 and 64, the GQA packing
  if (any_gdn) {
    ops::check_gated_delta_shapes(*this);  // key head dims 128 and 64
    if ((gdn_v_heads / gdn_k_heads) * gdn_v_dim > LILY_GDN_MAX_ROWS) bad_config("linear_value_head_dim", "(Hv/Hk) x dv must be at most 256");
    if (conv_kernel != LILY_GDN_CONV_KERNEL) bad_config("linear_conv_kernel_dim", "must be 4");
  }
}

size_t Switches::kv_growth_block() const { return kv_block ? kv_block : tuning::kKvCacheBlock; }

size_t dtype_size(DType dtype) { return dtype == DType::BF16 || dtype == DType::F16 ? 2 : 4; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::U32: return "u32";
  }
  return "?";
}

int Graph::add_buffer(const std::string& name, size_t length, BufferRole role) {
  buffers.push_back({name, std::max<size_t>(length, 16), role});
  return static_cast<int>(buffers.size()) - 1;
}

WeightTable synthetic_weights(const ModelConfig& c, Graph& graph) {
  WeightTable table;
  struct Pending {
    std::string name;
    WeightRef ref;
  };
  std::vector<Pending> pending;
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
  // Lay the tensors out back to back (16-byte aligned) in one virtual buffer, as a checkpoint file would hold them.
  auto place = [](Span& s, size_t& cursor, int buffer) {
    s.buffer = buffer;
    s.offset = cursor;
    cursor += (s.length + 15) / 16 * 16;
  };
  int file = graph.add_buffer("weights", 16, BufferRole::Weights);
  size_t cursor = 0;
  for (Pending& p : pending) {
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

StateLayout state_layout(const ModelConfig& c, Precision precision) {
  const size_t act = precision == Precision::Float32 ? 4 : 2;
  StateLayout s;
  s.conv_bytes = (c.conv_kernel - 1) * c.conv_dim() * act;
  s.recurrent_bytes = c.gdn_v_heads * c.gdn_v_dim * c.gdn_k_dim * 4;
  s.kv_bytes_per_row = c.num_kv_heads * c.head_dim * act;
  return s;
}

DecodeBuffers add_decode_buffers(const ModelConfig& c, Precision precision, size_t kv_capacity, size_t max_keys,
                                 Graph& g) {
  const size_t act = precision == Precision::Float32 ? 4 : 2, H = c.hidden_size;
  const size_t gdn_proj = c.conv_dim() + c.gdn_v_heads * c.gdn_v_dim + 2 * c.gdn_v_heads;
  const size_t attn_proj = (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  const size_t max_blocks = (max_keys + tuning::kAttentionSplitBlock - 1) / tuning::kAttentionSplitBlock;
  const size_t partials = (c.vocab_size + LILY_ARGMAX_BLOCK - 1) / LILY_ARGMAX_BLOCK;
  DecodeBuffers b;
  b.kv_capacity = kv_capacity;
  b.hidden = g.add_buffer("hidden", H * act, BufferRole::Scratch);
  b.normed = g.add_buffer("normed", H * act, BufferRole::Scratch);
  b.mixer_out = g.add_buffer("mixer out", H * act, BufferRole::Scratch);
  b.proj = g.add_buffer("projections", std::max(gdn_proj, attn_proj) * act, BufferRole::Scratch);
  b.gdn_out = g.add_buffer("deltanet out", c.gdn_v_heads * c.gdn_v_dim * act, BufferRole::Scratch);
  b.q = g.add_buffer("q", c.num_heads * c.head_dim * act, BufferRole::Scratch);
  b.gate = g.add_buffer("gate", c.num_heads * c.head_dim * act, BufferRole::Scratch);
  b.attn_out = g.add_buffer("attention out", c.num_heads * c.head_dim * act, BufferRole::Scratch);
  b.attn_partial_out = g.add_buffer("attention partials", c.num_heads * max_blocks * c.head_dim * 4, BufferRole::Scratch);
  b.attn_partial_stats = g.add_buffer("attention stats", c.num_heads * max_blocks * 2 * 4, BufferRole::Scratch);
  b.router = g.add_buffer("router logits", (c.num_experts + 1) * 4, BufferRole::Scratch);
  b.expert_ids = g.add_buffer("expert ids", c.top_k * 4, BufferRole::Scratch);
  b.expert_weights = g.add_buffer("expert weights", c.top_k * 4, BufferRole::Scratch);
  b.moe_hidden = g.add_buffer("moe hidden", (c.top_k * c.expert_size + c.shared_expert_size) * 4, BufferRole::Scratch);
  b.logits = g.add_buffer("logits", c.vocab_size * act, BufferRole::Io);
  b.argmax_values = g.add_buffer("argmax values", partials * 4, BufferRole::Scratch);
  b.argmax_ids = g.add_buffer("argmax ids", partials * 4, BufferRole::Scratch);
  b.tokens = g.add_buffer("tokens", 2 * 4, BufferRole::Io);  // two GPU token slots, alternating
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

namespace {

Span whole(const Graph& g, int buffer) { return Span{buffer, 0, g.buffers[buffer].length}; }

const WeightRef& weight(const WeightTable& w, const std::string& name) {
  auto found = w.find(name);
  if (found == w.end()) throw mtl::Error("[engine] the checkpoint has no tensor " + name);
  return found->second;
}

// The routed (switch_mlp) and shared expert weights of the MoE block `m` ("layers.N.mlp."); decode (MoeSpans) and
// prefill (MoePrefillSpans) name them alike.
template <typename MoeSpansT>
void bind_expert_weights(const WeightTable& w, const std::string& m, MoeSpansT& mo) {
  mo.gate = &weight(w, m + "switch_mlp.gate_proj.weight");
  mo.up = &weight(w, m + "switch_mlp.up_proj.weight");
  mo.down = &weight(w, m + "switch_mlp.down_proj.weight");
  mo.shared_gate = &weight(w, m + "shared_expert.gate_proj.weight");
  mo.shared_up = &weight(w, m + "shared_expert.up_proj.weight");
  mo.shared_down = &weight(w, m + "shared_expert.down_proj.weight");
}

// The Gated DeltaNet weights of the mixer `s` ("layers.N.linear_attn."); decode (GatedDeltaSpans) and prefill
// (GatedDeltaPrefillSpans) name them alike.
template <typename GatedDeltaSpansT>
void bind_deltanet_weights(const WeightTable& w, const std::string& s, GatedDeltaSpansT& gd) {
  gd.conv_weight = &weight(w, s + "conv1d.weight");
  gd.a_log = &weight(w, s + "A_log");
  gd.dt_bias = &weight(w, s + "dt_bias");
  gd.norm_weight = &weight(w, s + "norm.weight");
}

}  // namespace

void build_decode_step(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
                       const DecodeBuffers& b, size_t position, int token_slot, int next_slot, Graph& g) {
  const DType act = precision == Precision::Float32 ? DType::F32 : DType::BF16;
  const size_t a = dtype_size(act), H = c.hidden_size;
  ops::Context ctx{g, act, !sw.concurrent, sw.wide_tiles};
  ctx.gqa_packing = sw.gqa_packing;
  ctx.coalesced_kv = sw.coalesced_kv;
  Span hidden = whole(g, b.hidden), normed = whole(g, b.normed), mixer_out = whole(g, b.mixer_out);
  Span proj = whole(g, b.proj);
  const size_t split_min = sw.split_kv_min_keys ? sw.split_kv_min_keys : tuning::kAttentionSplitMinKeys;

  ops::embedding(ctx, whole(g, b.tokens), static_cast<size_t>(token_slot), weight(w, "embed_tokens.weight"), hidden, 1);
  // With fusion on, every RMSNorm of the hidden stream is folded into the GEMV(s) reading it (qmv_norm: each
  // simdgroup recomputes the row's sum of squares), the residual adds into the out/o projection (qmv_residual), and
  // moe_route with the post-attention norm into the experts' gate/up kernel: 6 dispatches per DeltaNet layer, 7 per
  // attention layer (short context), each depending on the one before.
  const bool fuse = sw.fusion;
  // `norm` (rms_norm(x) ⊙ norm, written to `normed`) in front of the GEMVs that read it: its own dispatch, or folded.
  auto normalise = [&](const std::string& label, const WeightRef& norm) -> Span {
    if (fuse) return hidden;
    ops::rms_norm(ctx, label, hidden, norm, normed, 1, H, c.eps);
    return normed;
  };
  auto gemv = [&](const std::string& label, const Span& x, const WeightRef& m, const Span& out, DType dtype,
                  const WeightRef& norm) {
    if (fuse) {
      ops::qmatmul_norm(ctx, label, x, norm, m, out, c.eps, dtype);
    } else {
      ops::qmatmul(ctx, label, x, m, out, 1, dtype);
    }
  };
  // Projections sharing an input: one segmented GEMV reading each matrix's own (mapped) bytes, or one GEMV per
  // matrix; either way each writes its slice of the same output.
  auto projections = [&](const std::string& label, const std::vector<std::string>& parts, const Span& x,
                         const Span& out, DType dtype, bool use_fused, const WeightRef& norm) {
    if (use_fused) {
      std::vector<const WeightRef*> refs;
      size_t rows = 0;
      for (const std::string& name : parts) {
        refs.push_back(&weight(w, name));
        rows += refs.back()->rows;
      }
      ops::qmatmul_segments(ctx, label, x, fuse ? &norm : nullptr, refs, parts, ops::sub(out, 0, rows * dtype_size(dtype)),
                            c.eps, dtype);
      return;
    }
    size_t offset = 0;
    for (const std::string& name : parts) {
      const WeightRef& p = weight(w, name);
      gemv(name, x, p, ops::sub(out, offset, p.rows * dtype_size(dtype)), dtype, norm);
      offset += p.rows * dtype_size(dtype);
    }
  };
  // The out/o projection: hidden += W · x in one GEMV, or into mixer_out (the residual add comes with the next norm).
  auto out_projection = [&](const std::string& label, const Span& x, const WeightRef& m) {
    if (fuse) {
      ops::qmatmul_residual(ctx, label, x, m, hidden);
    } else {
      ops::qmatmul(ctx, label, x, m, mixer_out, 1, act);
    }
  };
  for (size_t i = 0; i < c.num_layers(); ++i) {
    const std::string p = layer_prefix(i);
    const WeightRef& input_norm = weight(w, p + "input_layernorm.weight");
    const Span mixer_in = normalise(p + "input_layernorm", input_norm);
    if (c.attention_layers[i]) {
      const std::string s = p + "self_attn.";
      const size_t qg = 2 * c.num_heads * c.head_dim * a, kv = c.num_kv_heads * c.head_dim * a;
      projections(s + "in_proj", {s + "q_proj.weight", s + "k_proj.weight", s + "v_proj.weight"},
                  mixer_in, proj, act, sw.fused_projections, input_norm);
      ops::AttentionSpans at;
      at.q_and_gate = ops::sub(proj, 0, qg);
      at.k = ops::sub(proj, qg, kv);
      at.v = ops::sub(proj, qg + kv, kv);
      at.q = whole(g, b.q);
      at.gate = whole(g, b.gate);
      at.out = whole(g, b.attn_out);
      at.k_cache = whole(g, b.k_cache[i]);
      at.v_cache = whole(g, b.v_cache[i]);
      at.partial_out = whole(g, b.attn_partial_out);
      at.partial_stats = whole(g, b.attn_partial_stats);
      at.q_norm = &weight(w, s + "q_norm.weight");
      at.k_norm = &weight(w, s + "k_norm.weight");
      at.capacity = b.kv_capacity;
      bool split = sw.split_kv && position + 1 >= split_min;
      ops::attention_decode(ctx, c, p + "attention", at, position, split);
      out_projection(s + "o_proj", at.out, weight(w, s + "o_proj.weight"));
    } else {
      const std::string s = p + "linear_attn.";
      const size_t C = c.conv_dim() * a, vd = c.gdn_v_heads * c.gdn_v_dim * a, hv = c.gdn_v_heads * a;
      projections(s + "in_proj",
                  {s + "in_proj_qkv.weight", s + "in_proj_z.weight", s + "in_proj_b.weight", s + "in_proj_a.weight"},
                  mixer_in, proj, act, sw.fused_projections, input_norm);
      ops::GatedDeltaSpans gd;
      gd.qkv = ops::sub(proj, 0, C);
      gd.z = ops::sub(proj, C, vd);
      gd.b = ops::sub(proj, C + vd, hv);
      gd.a = ops::sub(proj, C + vd + hv, hv);
      gd.out = whole(g, b.gdn_out);
      gd.conv_state = whole(g, b.conv_state[i]);
      gd.recurrent_state = whole(g, b.recurrent_state[i]);
      bind_deltanet_weights(w, s, gd);
      ops::gated_delta_step(ctx, c, p + "deltanet", gd);
      out_projection(s + "out_proj", gd.out, weight(w, s + "out_proj.weight"));
    }
    const WeightRef& post_norm = weight(w, p + "post_attention_layernorm.weight");
    if (!fuse) {
      // hidden += mixer out (in place), normed = post_attention_layernorm(hidden).
      ops::rms_norm_residual(ctx, p + "post_attention_layernorm", mixer_out, hidden, post_norm, normed, hidden, 1, H,
                             c.eps);
    }
    const Span moe_in = fuse ? hidden : normed;
    const std::string m = p + "mlp.";
    // Router logits stay f32 (moe_route and moe_down_combine read f32).
    projections(m + "router", {m + "gate.weight", m + "shared_expert_gate.weight"}, moe_in,
                whole(g, b.router), DType::F32, sw.fused_projections, post_norm);
    ops::MoeSpans mo;
    mo.x = moe_in;
    mo.router_logits = whole(g, b.router);
    mo.expert_ids = whole(g, b.expert_ids);
    mo.expert_weights = whole(g, b.expert_weights);
    mo.hidden = whole(g, b.moe_hidden);
    mo.residual_out = hidden;
    bind_expert_weights(w, m, mo);
    if (fuse) {
      ops::moe_decode_routed(ctx, c, p + "moe", mo, post_norm, c.eps);
    } else {
      ops::moe_decode(ctx, c, p + "moe", mo);
    }
  }
  const WeightRef& final_norm = weight(w, "norm.weight");
  Span logits = whole(g, b.logits);
  gemv("lm_head", normalise("norm", final_norm), weight(w, "lm_head.weight"), logits, act, final_norm);
  if (sw.gpu_token) {
    ops::argmax(ctx, logits, c.vocab_size, whole(g, b.argmax_values), whole(g, b.argmax_ids), whole(g, b.tokens),
                static_cast<size_t>(next_slot));
  }
}

// ---- prefill ----

PrefillBuffers add_prefill_buffers(const ModelConfig& c, Precision precision, size_t max_tokens, Graph& g) {
  const size_t a = precision == Precision::Float32 ? 4 : 2, T = max_tokens, H = c.hidden_size;
  const size_t vd = c.gdn_v_heads * c.gdn_v_dim, pairs = T * c.top_k;
  const size_t blocks = (pairs + LILY_MOE_SORT_BLOCK - 1) / LILY_MOE_SORT_BLOCK;
  PrefillBuffers p;
  p.max_tokens = T;
  auto scratch = [&](const char* name, size_t bytes) { return g.add_buffer(std::string("prefill ") + name, bytes, BufferRole::Scratch); };
  auto io = [&](const char* name, size_t bytes) { return g.add_buffer(std::string("prefill ") + name, bytes, BufferRole::Io); };
  p.ids = io("ids", T * 4);
  p.hidden = scratch("hidden", T * H * a);
  p.normed = scratch("normed", T * H * a);
  p.mixer_out = scratch("mixer out", T * H * a);
  p.qkv = scratch("qkv", T * c.conv_dim() * a);
  p.z = scratch("z", T * vd * a);
  p.b = scratch("b", T * c.gdn_v_heads * a);
  p.a = scratch("a", T * c.gdn_v_heads * a);
  p.conv_out = scratch("conv out", T * c.conv_dim() * 4);
  p.gdn_out = scratch("deltanet out", T * vd * a);
  p.q_and_gate = scratch("q and gate", T * 2 * c.num_heads * c.head_dim * a);
  p.k = scratch("k", T * c.num_kv_heads * c.head_dim * a);
  p.v = scratch("v", T * c.num_kv_heads * c.head_dim * a);
  p.q = scratch("q", T * c.num_heads * c.head_dim * a);
  p.gate = scratch("gate", T * c.num_heads * c.head_dim * a);
  p.attn_out = scratch("attention out", T * c.num_heads * c.head_dim * a);
  p.router = scratch("router logits", T * c.num_experts * 4);
  p.shared_gate_logit = scratch("shared gate logit", T * 4);
  p.expert_ids = scratch("expert ids", pairs * 4);
  p.expert_weights = scratch("expert weights", pairs * 4);
  p.block_counts = scratch("block counts", blocks * c.num_experts * 4);
  p.expert_offsets = scratch("expert offsets", (c.num_experts + 1) * 4);
  p.tile_map = scratch("tile map", ops::moe_max_tiles(pairs, c.num_experts, 16) * 16);
  p.tile_count = scratch("tile count", 4);
  p.sorted_pairs = scratch("sorted pairs", pairs * 4);
  p.moe_hidden = scratch("moe hidden", pairs * c.expert_size * a);
  p.expert_out = scratch("expert out", pairs * H * a);
  p.shared_pairs = io("shared pairs", T * 4);
  p.shared_tile_map = io("shared tile map", (T + 15) / 16 * 16);
  p.shared_tile_count = io("shared tile count", 4);
  p.ones = io("ones", T * 4);
  p.shared_hidden = scratch("shared hidden", T * c.shared_expert_size * a);
  p.shared_out = scratch("shared out", T * H * a);
  p.logits = io("logits", T * c.vocab_size * a);
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

void build_prefill_chunk(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
                         const DecodeBuffers& state, const PrefillBuffers& p, size_t position, size_t T, Graph& g) {
  const DType act = precision == Precision::Float32 ? DType::F32 : DType::BF16;
  const size_t a = dtype_size(act), H = c.hidden_size;
  ops::Context ctx{g, act, !sw.concurrent, sw.wide_tiles};
  ctx.gpu_routing = sw.gpu_routing;
  ctx.in_gemm_dequant = sw.in_gemm_dequant;
  if (p.dequant >= 0) ctx.dequant_scratch = whole(g, p.dequant);
  ctx.register_scan = sw.register_scan;
  ctx.mma_attention = sw.mma_attention;
  auto rows = [&](int buffer, size_t row_bytes) { return Span{buffer, 0, T * row_bytes}; };
  Span hidden = rows(p.hidden, H * a), normed = rows(p.normed, H * a), mixer_out = rows(p.mixer_out, H * a);
  ops::embedding(ctx, rows(p.ids, 4), 0, weight(w, "embed_tokens.weight"), hidden, T);
  for (size_t i = 0; i < c.num_layers(); ++i) {
    const std::string pre = layer_prefix(i);
    ops::rms_norm(ctx, pre + "input_layernorm", hidden, weight(w, pre + "input_layernorm.weight"), normed, T, H, c.eps);
    if (c.attention_layers[i]) {
      const std::string s = pre + "self_attn.";
      ops::AttentionSpans at;
      at.q_and_gate = rows(p.q_and_gate, 2 * c.num_heads * c.head_dim * a);
      at.k = rows(p.k, c.num_kv_heads * c.head_dim * a);
      at.v = rows(p.v, c.num_kv_heads * c.head_dim * a);
      at.q = rows(p.q, c.num_heads * c.head_dim * a);
      at.gate = rows(p.gate, c.num_heads * c.head_dim * a);
      at.out = rows(p.attn_out, c.num_heads * c.head_dim * a);
      at.k_cache = whole(g, state.k_cache[i]);
      at.v_cache = whole(g, state.v_cache[i]);
      at.q_norm = &weight(w, s + "q_norm.weight");
      at.k_norm = &weight(w, s + "k_norm.weight");
      at.capacity = state.kv_capacity;
      ops::qmatmul(ctx, s + "q_proj", normed, weight(w, s + "q_proj.weight"), at.q_and_gate, T, act);
      ops::qmatmul(ctx, s + "k_proj", normed, weight(w, s + "k_proj.weight"), at.k, T, act);
      ops::qmatmul(ctx, s + "v_proj", normed, weight(w, s + "v_proj.weight"), at.v, T, act);
      ops::attention_prefill(ctx, c, pre + "attention", at, position, T);
      ops::qmatmul(ctx, s + "o_proj", at.out, weight(w, s + "o_proj.weight"), mixer_out, T, act);
    } else {
      const std::string s = pre + "linear_attn.";
      ops::GatedDeltaPrefillSpans gd;
      gd.qkv = rows(p.qkv, c.conv_dim() * a);
      gd.z = rows(p.z, c.gdn_v_heads * c.gdn_v_dim * a);
      gd.b = rows(p.b, c.gdn_v_heads * a);
      gd.a = rows(p.a, c.gdn_v_heads * a);
      gd.conv_out = rows(p.conv_out, c.conv_dim() * 4);
      gd.out = rows(p.gdn_out, c.gdn_v_heads * c.gdn_v_dim * a);
      gd.conv_state = whole(g, state.conv_state[i]);
      gd.recurrent_state = whole(g, state.recurrent_state[i]);
      bind_deltanet_weights(w, s, gd);
      ops::qmatmul(ctx, s + "in_proj_qkv", normed, weight(w, s + "in_proj_qkv.weight"), gd.qkv, T, act);
      ops::qmatmul(ctx, s + "in_proj_z", normed, weight(w, s + "in_proj_z.weight"), gd.z, T, act);
      ops::qmatmul(ctx, s + "in_proj_b", normed, weight(w, s + "in_proj_b.weight"), gd.b, T, act);
      ops::qmatmul(ctx, s + "in_proj_a", normed, weight(w, s + "in_proj_a.weight"), gd.a, T, act);
      ops::gated_delta_prefill(ctx, c, pre + "deltanet", gd, T);
      ops::qmatmul(ctx, s + "out_proj", gd.out, weight(w, s + "out_proj.weight"), mixer_out, T, act);
    }
    ops::rms_norm_residual(ctx, pre + "post_attention_layernorm", mixer_out, hidden,
                           weight(w, pre + "post_attention_layernorm.weight"), normed, hidden, T, H, c.eps);
    const std::string m = pre + "mlp.";
    ops::MoePrefillSpans mo;
    mo.x = normed;
    mo.router_logits = rows(p.router, c.num_experts * 4);
    mo.shared_gate_logit = rows(p.shared_gate_logit, 4);
    ops::moe_router_logits(ctx, m + "gate", normed, weight(w, m + "gate.weight"), mo.router_logits, T);
    ops::moe_router_logits(ctx, m + "shared_expert_gate", normed, weight(w, m + "shared_expert_gate.weight"),
                           mo.shared_gate_logit, T);
    mo.expert_ids = whole(g, p.expert_ids);
    mo.expert_weights = whole(g, p.expert_weights);
    mo.block_counts = whole(g, p.block_counts);
    mo.expert_offsets = whole(g, p.expert_offsets);
    mo.tile_map = whole(g, p.tile_map);
    mo.tile_count = whole(g, p.tile_count);
    mo.sorted_pairs = whole(g, p.sorted_pairs);
    mo.hidden = whole(g, p.moe_hidden);
    mo.expert_out = whole(g, p.expert_out);
    mo.shared_pairs = whole(g, p.shared_pairs);
    mo.shared_tile_map = whole(g, p.shared_tile_map);
    mo.shared_tile_count = whole(g, p.shared_tile_count);
    mo.ones = whole(g, p.ones);
    mo.shared_hidden = whole(g, p.shared_hidden);
    mo.shared_out = whole(g, p.shared_out);
    mo.residual_out = hidden;
    bind_expert_weights(w, m, mo);
    ops::moe_prefill(ctx, c, pre + "moe", mo, T);
  }
  ops::rms_norm(ctx, "norm", hidden, weight(w, "norm.weight"), normed, T, H, c.eps);
  ops::qmatmul(ctx, "lm_head", normed, weight(w, "lm_head.weight"), rows(p.logits, c.vocab_size * a), T, act);
}

void host_moe_sort(const HostMoeSort& s, const uint32_t* ids, uint32_t* expert_offsets, uint32_t* tile_map,
                   uint32_t* tile_count, uint32_t* sorted_pairs) {
  std::vector<uint32_t> counts(s.experts, 0);
  for (size_t p = 0; p < s.pairs; ++p) {
    if (ids[p] >= s.experts) {
      throw mtl::Error("[engine] MoE routing wrote expert id " + std::to_string(ids[p]) + " for pair " +
                       std::to_string(p) + "; the layer has " + std::to_string(s.experts) + " experts");
    }
    ++counts[ids[p]];
  }
  uint32_t rows = 0, tiles = 0;
  for (size_t e = 0; e < s.experts; ++e) {
    expert_offsets[e] = rows;
    for (uint32_t first = 0; first < counts[e]; first += static_cast<uint32_t>(s.tile_rows)) {
      if (tiles >= s.max_tiles) throw std::logic_error("[engine] MoE tile map bound exceeded");
      uint32_t* entry = tile_map + static_cast<size_t>(tiles++) * 4;
      entry[0] = static_cast<uint32_t>(e);
      entry[1] = rows + first;
      entry[2] = std::min(static_cast<uint32_t>(s.tile_rows), counts[e] - first);
      entry[3] = 0;
    }
    rows += counts[e];
  }
  expert_offsets[s.experts] = rows;
  *tile_count = tiles;
  // Stable: within an expert, pairs in ascending order (as moe_sort_scatter writes them).
  std::vector<uint32_t> cursor(expert_offsets, expert_offsets + s.experts);
  for (size_t p = 0; p < s.pairs; ++p) sorted_pairs[cursor[ids[p]]++] = static_cast<uint32_t>(p);
}

// ---- mapped files ----

namespace {

// Apple silicon's page size: newBufferWithBytesNoCopy wants the pointer and the length aligned to it.
constexpr size_t kMetalPage = 16384;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

MappedFile::MappedFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw mtl::Error("[engine] cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    throw mtl::Error("[engine] " + path + " is empty or cannot be read");
  }
  file_length_ = static_cast<size_t>(st.st_size);
  mapped_length_ = round_up(file_length_, kMetalPage);
  // Reserve one extra page so the file can be placed at a 16 KB boundary; the reservation's zero pages pad the
  // mapping to whole pages.
  reservation_length_ = mapped_length_ + kMetalPage;
  reservation_ = ::mmap(nullptr, reservation_length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0);
  if (reservation_ == MAP_FAILED) {
    ::close(fd);
    reservation_ = nullptr;
    throw mtl::Error("[engine] cannot reserve " + std::to_string(reservation_length_) + " bytes to map " + path);
  }
  void* aligned = reinterpret_cast<void*>(round_up(reinterpret_cast<uintptr_t>(reservation_), kMetalPage));
  // Private and writable: nothing the engine does writes to weights, but a write (the Linux test runtime copies
  // every bound range back after a dispatch) must land in a private copy, never in the file.
  void* mapped = ::mmap(aligned, file_length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0);
  ::close(fd);
  if (mapped == MAP_FAILED) {
    ::munmap(reservation_, reservation_length_);
    reservation_ = nullptr;
    throw mtl::Error("[engine] cannot map " + path + ": " + std::strerror(errno));
  }
  data_ = mapped;
}

MappedFile::~MappedFile() {
  if (reservation_) ::munmap(reservation_, reservation_length_);
}

// ---- the engine ----

Engine::Engine(const ModelConfig& config, Precision precision, const Switches& switches, size_t max_context,
               const std::vector<KernelFamily>& kernel_families, const std::optional<MetallibFile>& metallib)
    : config_(config), precision_(precision), switches_(switches), max_context_(max_context) {
  config_.validate();
  config_.check_kernel_shapes();
  if (max_context_ == 0) throw mtl::Error("[engine] max_context must be positive");
  device_ = metallib ? std::make_unique<Device>(*metallib) : std::make_unique<Device>(kernel_families);
  if (switches_.mma_attention && !simdgroup_layout_matches(*device_)) {
    std::fprintf(stderr, "lily: this GPU's simdgroup_matrix lane layout differs from the one attention_prefill_mma "
                         "assumes; prefill attention uses the vector kernel\n");
    switches_.mma_attention = false;
  }
}

Engine::~Engine() = default;

int Engine::add_file(const std::string& path) {
  files_.push_back(std::make_unique<MappedFile>(path));
  const MappedFile& file = *files_.back();
  int id = base_.add_buffer(path, file.mapped_length(), BufferRole::Weights);
  buffers_.push_back(device_->wrap_memory(file.data(), file.mapped_length()));
  return id;
}

int Engine::add_owned(const void* data, size_t length) {
  int id = base_.add_buffer("materialised weights", length, BufferRole::Weights);
  buffers_.push_back(device_->new_buffer(base_.buffers[id].length));
  if (length) std::memcpy(buffers_.back().contents(), data, length);
  owned_bytes_ += length;
  return id;
}

void Engine::bind_weight(const std::string& name, const WeightRef& ref) {
  if (loaded_) throw mtl::Error("[engine] " + name + ": weights are bound before finish_loading");
  for (const Span* span : {&ref.data, &ref.scales, &ref.biases}) {
    if (span->length == 0 && span != &ref.data) continue;
    if (span->buffer < 0 || static_cast<size_t>(span->buffer) >= buffers_.size() ||
        span->offset + span->length > base_.buffers[span->buffer].length) {
      throw mtl::Error("[engine] " + name + ": its byte range is not inside a loaded file or buffer");
    }
  }
  if (ref.bits && ref.cols % 64) throw mtl::Error("[engine] " + name + ": input features must be a multiple of 64");
  weights_[name] = ref;
}

void Engine::finish_loading() {
  // Dense tensors are read by kernels templated on the activation dtype, except A_log and dt_bias (always f32).
  const DType act = precision_ == Precision::Float32 ? DType::F32 : DType::BF16;
  for (const auto& [name, w] : weights_) {
    if (w.bits) continue;
    DType wanted = ends_with(name, "A_log") || ends_with(name, "dt_bias") ? DType::F32 : act;
    if (w.dtype != wanted) {
      throw mtl::Error("[engine] " + name + " must be bound as " + dtype_name(wanted) + " for this precision; got " +
                       dtype_name(w.dtype));
    }
  }
  size_t first_new = base_.buffers.size();
  decode_ = add_decode_buffers(config_, precision_, std::min(max_context_, switches_.kv_growth_block()), max_context_,
                               base_);
  for (size_t i = first_new; i < base_.buffers.size(); ++i) buffers_.push_back(device_->new_buffer(base_.buffers[i].length));
  // A dry build names any missing tensor now rather than at the first token.
  Graph probe;
  probe.buffers = base_.buffers;
  build_decode_step(config_, precision_, switches_, weights_, decode_, 0, 0, 1, probe);
  // Every decode pipeline is built now: a kernel missing for this checkpoint's quantization is named at load, and
  // the first token does not pay for compilation.
  for (const Node& node : probe.nodes) device_->pipeline(node.kernel);
  loaded_ = true;
  reset();
}

void Engine::reset() {
  for (size_t i = 0; i < base_.buffers.size(); ++i) {
    if (base_.buffers[i].role == BufferRole::State || base_.buffers[i].role == BufferRole::Io) {
      std::memset(buffers_[i].contents(), 0, buffers_[i].length());
    }
  }
  position_ = 0;
}

void Engine::ensure_capacity(size_t keys) {
  if (keys > max_context_) {
    throw mtl::Error("[engine] the context limit is " + std::to_string(max_context_) + " tokens; this call needs " +
                     std::to_string(keys));
  }
  const size_t old_capacity = decode_.kv_capacity;
  if (keys <= old_capacity) return;
  const size_t capacity = std::min(round_up(keys, switches_.kv_growth_block()), max_context_);
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;  // one head
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    for (int id : {decode_.k_cache[layer], decode_.v_cache[layer]}) {
      if (id < 0) continue;
      Buffer grown = device_->new_buffer(config_.num_kv_heads * capacity * row);
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        std::memcpy(static_cast<char*>(grown.contents()) + h * capacity * row,
                    static_cast<const char*>(buffers_[id].contents()) + h * old_capacity * row, position_ * row);
      }
      buffers_[id] = std::move(grown);
      base_.buffers[id].length = buffers_[id].length();
    }
  }
  decode_.kv_capacity = capacity;
}

std::unique_ptr<Encoder> Engine::encode_step(uint32_t token_slot, long dropped_barrier) {
  Graph graph;
  graph.buffers = base_.buffers;
  build_decode_step(config_, precision_, switches_, weights_, decode_, position_, static_cast<int>(token_slot),
                    static_cast<int>(1 - token_slot), graph);
  return encode_graph(std::move(graph), dropped_barrier);
}

std::unique_ptr<Encoder> Engine::encode_graph(Graph graph, long dropped_barrier) {
  std::unique_ptr<Encoder> encoder = encode_nodes(graph, stage_starts(graph), 0, graph.nodes.size(), dropped_barrier);
  last_graph_ = std::move(graph);
  return encoder;
}

std::unique_ptr<Encoder> Engine::encode_nodes(const Graph& graph, const std::vector<bool>& starts, size_t begin,
                                              size_t end, long dropped_barrier) {
  const bool manual = dropped_barrier >= 0;
  auto encoder = std::make_unique<Encoder>(*device_, manual ? BarrierPolicy::Manual : BarrierPolicy::Automatic);
  auto ranges = [&](const std::vector<Span>& spans) {
    std::vector<BufferRange> out;
    for (const Span& s : spans) out.push_back({&buffer(s.buffer), s.offset, s.length});
    return out;
  };
  for (size_t i = begin; i < end; ++i) {
    const Node& node = graph.nodes[i];
    // Automatic: the Encoder places barriers from the ranges (serial mode adds one before every node). Manual:
    // the same places, computed here, with one left out.
    if (manual ? (i > begin && starts[i] && static_cast<long>(i) != dropped_barrier) : node.barrier_before) {
      encoder->barrier();
    }
    std::vector<Argument> args;
    for (const NodeArg& a : node.args) {
      args.push_back(a.buffer >= 0 ? Argument::buffer(buffer(a.buffer), a.offset)
                                   : Argument::bytes(a.bytes.data(), a.bytes.size()));
    }
    encoder->dispatch(device_->pipeline(node.kernel), args, node.groups, node.threads, ranges(node.reads),
                      ranges(node.writes));
  }
  return encoder;
}

void Engine::run_graph(Graph graph, long dropped_barrier) {
  if (graph.host_sorts.empty()) {
    std::unique_ptr<Encoder> encoder = encode_graph(std::move(graph), dropped_barrier);
    encoder->commit();
    encoder->wait();
    return;
  }
  const std::vector<bool> starts = stage_starts(graph);
  size_t begin = 0;
  for (const HostMoeSort& sort : graph.host_sorts) {
    std::unique_ptr<Encoder> encoder = encode_nodes(graph, starts, begin, sort.before_node, dropped_barrier);
    encoder->commit();
    encoder->wait();
    run_host_sort(sort);
    begin = sort.before_node;
  }
  std::unique_ptr<Encoder> encoder = encode_nodes(graph, starts, begin, graph.nodes.size(), dropped_barrier);
  encoder->commit();
  encoder->wait();
  last_graph_ = std::move(graph);
}

void Engine::run_host_sort(const HostMoeSort& sort) {
  auto at = [&](const Span& span) {
    return reinterpret_cast<uint32_t*>(static_cast<unsigned char*>(buffers_[span.buffer].contents()) + span.offset);
  };
  host_moe_sort(sort, at(sort.expert_ids), at(sort.expert_offsets), at(sort.tile_map), at(sort.tile_count),
                at(sort.sorted_pairs));
}

void Engine::read_rows(int buffer_id, size_t rows, float* out) const {
  const size_t n = rows * config_.vocab_size;
  const Buffer& logits = buffer(buffer_id);
  if (precision_ == Precision::Float32) {
    std::memcpy(out, logits.contents(), n * 4);
    return;
  }
  const auto* bf16 = static_cast<const uint16_t*>(logits.contents());
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(bf16[i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

void Engine::ensure_prefill_rows(size_t rows) {
  if (has_prefill_ && prefill_.max_tokens >= rows) return;
  // The prefill scratch is the last group of buffers: a larger chunk replaces the group (same ids, new sizes).
  if (has_prefill_) {
    base_.buffers.erase(base_.buffers.begin() + static_cast<long>(prefill_first_buffer_), base_.buffers.end());
    buffers_.erase(buffers_.begin() + static_cast<long>(prefill_first_buffer_), buffers_.end());
  }
  prefill_first_buffer_ = base_.buffers.size();
  prefill_ = add_prefill_buffers(config_, precision_, rows, base_);
  if (!switches_.in_gemm_dequant) prefill_.dequant = add_dequant_scratch(precision_, weights_, base_);
  for (size_t i = prefill_first_buffer_; i < base_.buffers.size(); ++i) {
    buffers_.push_back(device_->new_buffer(base_.buffers[i].length));
  }
  has_prefill_ = true;
}

void Engine::prefill_chunk(const uint32_t* tokens, size_t count, float* logits, long dropped_barrier) {
  const size_t chunk = switches_.prefill_chunk ? switches_.prefill_chunk : tuning::kPrefillChunk;
  ensure_prefill_rows(std::max(count, std::min(chunk, max_context_)));
  SharedExpertRouting routing = shared_expert_routing(count, switches_.wide_tiles);
  auto put = [&](int id, const void* data, size_t bytes) { std::memcpy(buffers_[id].contents(), data, bytes); };
  put(prefill_.ids, tokens, count * 4);
  put(prefill_.shared_pairs, routing.pairs.data(), routing.pairs.size() * 4);
  put(prefill_.ones, routing.ones.data(), routing.ones.size() * 4);
  put(prefill_.shared_tile_map, routing.tile_map.data(), routing.tile_map.size() * 4);
  put(prefill_.shared_tile_count, &routing.tile_count, 4);
  Graph graph;
  graph.buffers = base_.buffers;
  build_prefill_chunk(config_, precision_, switches_, weights_, decode_, prefill_, position_, count, graph);
  run_graph(std::move(graph), dropped_barrier);
  read_rows(prefill_.logits, count, logits);
  position_ += count;
}

void Engine::forward(const std::vector<uint32_t>& tokens, float* logits, long dropped_barrier) {
  if (!loaded_) throw mtl::Error("[engine] forward before finish_loading");
  for (uint32_t token : tokens) {
    if (token >= config_.vocab_size) {
      throw mtl::Error("[engine] token id " + std::to_string(token) + " is not below vocab_size " +
                       std::to_string(config_.vocab_size));
    }
  }
  ensure_capacity(position_ + tokens.size());
  if (switches_.batched_prefill && tokens.size() > 1) {
    const size_t chunk = !switches_.chunked_prefill ? tokens.size()
                         : std::min(switches_.prefill_chunk ? switches_.prefill_chunk : tuning::kPrefillChunk,
                                    max_context_);
    for (size_t start = 0; start < tokens.size(); start += chunk) {
      const size_t count = std::min(chunk, tokens.size() - start);
      prefill_chunk(tokens.data() + start, count, logits + start * config_.vocab_size, dropped_barrier);
    }
    return;
  }
  for (size_t t = 0; t < tokens.size(); ++t) {
    static_cast<uint32_t*>(buffer(decode_.tokens).contents())[0] = tokens[t];
    std::unique_ptr<Encoder> encoder = encode_step(0, dropped_barrier);
    encoder->commit();
    encoder->wait();
    read_rows(decode_.logits, 1, logits + t * config_.vocab_size);
    ++position_;
  }
}

std::vector<uint32_t> Engine::generate_greedy(uint32_t first, size_t count) {
  if (!loaded_) throw mtl::Error("[engine] generate before finish_loading");
  if (!switches_.gpu_token) throw mtl::Error("[engine] generate_greedy needs the GPU token switch on");
  if (first >= config_.vocab_size) throw mtl::Error("[engine] token id " + std::to_string(first) + " is out of range");
  // Grown up front: a growth re-allocates the caches, which a command buffer in flight may be using.
  ensure_capacity(position_ + count);
  auto* slots = static_cast<uint32_t*>(buffer(decode_.tokens).contents());
  slots[0] = first;
  std::vector<uint32_t> out;
  std::unique_ptr<Encoder> in_flight;
  for (size_t k = 0; k < count; ++k) {
    std::unique_ptr<Encoder> next = encode_step(static_cast<uint32_t>(k % 2), -1);
    next->commit();
    ++position_;
    if (in_flight) {
      in_flight->wait();
      out.push_back(slots[k % 2]);  // written by step k-1; step k+1 (the next writer of this slot) is not committed
    }
    in_flight = std::move(next);
  }
  if (in_flight) {
    in_flight->wait();
    out.push_back(slots[count % 2]);
  }
  return out;
}

size_t Engine::snapshot_bytes(size_t position) const {
  StateLayout s = state_layout(config_, precision_);
  size_t total = 0;
  for (bool attention : config_.attention_layers) {
    total += attention ? 2 * position * s.kv_bytes_per_row : s.conv_bytes + s.recurrent_bytes;
  }
  return total;
}

std::vector<unsigned char> Engine::snapshot() const {
  std::vector<unsigned char> out;
  out.reserve(snapshot_bytes(position_));
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    if (!config_.attention_layers[layer]) {
      for (int id : {decode_.conv_state[layer], decode_.recurrent_state[layer]}) {
        const auto* p = static_cast<const unsigned char*>(buffer(id).contents());
        out.insert(out.end(), p, p + base_.buffers[id].length);
      }
      continue;
    }
    for (int id : {decode_.k_cache[layer], decode_.v_cache[layer]}) {
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        const auto* p = static_cast<const unsigned char*>(buffer(id).contents()) + h * decode_.kv_capacity * row;
        out.insert(out.end(), p, p + position_ * row);
      }
    }
  }
  return out;
}

void Engine::restore(const unsigned char* snapshot, size_t length, size_t position) {
  if (length != snapshot_bytes(position)) {
    throw mtl::Error("[engine] snapshot of " + std::to_string(length) + " bytes does not match " +
                     std::to_string(position) + " tokens of this model's state");
  }
  position_ = 0;
  ensure_capacity(std::max<size_t>(position, 1));
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;
  const unsigned char* p = snapshot;
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    if (!config_.attention_layers[layer]) {
      for (int id : {decode_.conv_state[layer], decode_.recurrent_state[layer]}) {
        std::memcpy(buffers_[id].contents(), p, base_.buffers[id].length);
        p += base_.buffers[id].length;
      }
      continue;
    }
    for (int id : {decode_.k_cache[layer], decode_.v_cache[layer]}) {
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        std::memcpy(static_cast<unsigned char*>(buffers_[id].contents()) + h * decode_.kv_capacity * row, p,
                    position * row);
        p += position * row;
      }
    }
  }
  position_ = position;
}

}  // namespace lily
