// The prefill chunk's graph: T tokens through every layer with T-row kernels (see model.h).
#include "model.h"

#include <algorithm>
#include <stdexcept>

#include "../../metal/lily.h"
#include "graph_build.h"
#include "ops/ops.h"
#include "tuning.h"

namespace lily {

using graph::bind_deltanet_weights;
using graph::bind_expert_weights;
using graph::layer_prefix;
using graph::weight;
using graph::whole;

PrefillBuffers add_prefill_buffers(const ModelConfig& c, Precision precision, size_t max_tokens, size_t max_logit_rows,
                                   Graph& g) {
  const size_t a = precision == Precision::Float32 ? 4 : 2, T = max_tokens, H = c.hidden_size;
  const size_t vd = c.gdn_v_heads * c.gdn_v_dim, pairs = T * c.top_k;
  const size_t blocks = (pairs + LILY_MOE_SORT_BLOCK - 1) / LILY_MOE_SORT_BLOCK;
  PrefillBuffers p;
  p.max_tokens = T;
  p.max_logit_rows = std::max<size_t>(max_logit_rows, 1);
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
  p.gdn_core_out = scratch("deltanet core out", T * c.gdn_v_heads * c.gdn_v_dim * 4);  // f32 scan output
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
  // f32 in every precision, as the decode step's; [V] f32 per row (1 MB at full size), so only the rows asked for.
  p.logits = io("logits", p.max_logit_rows * c.vocab_size * 4);
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

int add_gdn_chunk_scratch(const ModelConfig& c, size_t max_tokens, Graph& g) {
  const size_t bytes = ops::gated_delta_chunk_scratch_bytes(c, max_tokens);
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

namespace {

// One prefill chunk under construction: what its dispatches share (configuration, weights, the decode state, the
// chunk's scratch, the op context and the hidden-stream rows), and the pieces build_prefill_chunk puts together, one
// method each.
struct PrefillChunk {
  const ModelConfig& c;
  const WeightTable& w;
  const DecodeBuffers& state;
  const PrefillBuffers& p;
  Graph& g;
  size_t position, T;
  DType act;
  size_t a, H;
  ops::Context ctx;
  Span hidden, normed, mixer_out;

  PrefillChunk(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
               const DecodeBuffers& state, const PrefillBuffers& p, size_t position, size_t T, Graph& g)
      : c(c), w(w), state(state), p(p), g(g), position(position), T(T),
        act(precision == Precision::Float32 ? DType::F32 : DType::BF16), a(dtype_size(act)), H(c.hidden_size),
        ctx{g, act, !sw.concurrent, sw.wide_tiles}, hidden(rows(p.hidden, H * a)), normed(rows(p.normed, H * a)),
        mixer_out(rows(p.mixer_out, H * a)) {
    ctx.gpu_routing = sw.gpu_routing;
    ctx.in_gemm_dequant = sw.in_gemm_dequant;
    if (p.dequant >= 0) ctx.dequant_scratch = whole(g, p.dequant);
    ctx.register_scan = sw.register_scan;
    ctx.chunked_scan = sw.chunked_scan;
    if (p.gdn_chunks >= 0) ctx.gdn_chunks = whole(g, p.gdn_chunks);
    ctx.tensor_ops = sw.tensor_ops;
    ctx.mma_attention = sw.mma_attention;
  }

  // The chunk's first T rows of `buffer`, `row_bytes` each.
  Span rows(int buffer, size_t row_bytes) const { return Span{buffer, 0, T * row_bytes}; }

  // Layer i's mixer when it is full attention: the q (with its gate), k and v projections of `normed`, attention over
  // the cache and the chunk, then o_proj into `mixer_out`.
  void attention_mixer(size_t i, const std::string& pre) {
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
  }

  // Layer i's mixer when it is a Gated DeltaNet: the qkv, z, b and a projections of `normed`, the chunked scan (conv
  // and recurrent state in place), then out_proj into `mixer_out`.
  void deltanet_mixer(size_t i, const std::string& pre) {
    const std::string s = pre + "linear_attn.";
    ops::GatedDeltaPrefillSpans gd;
    gd.qkv = rows(p.qkv, c.conv_dim() * a);
    gd.z = rows(p.z, c.gdn_v_heads * c.gdn_v_dim * a);
    gd.b = rows(p.b, c.gdn_v_heads * a);
    gd.a = rows(p.a, c.gdn_v_heads * a);
    gd.conv_out = rows(p.conv_out, c.conv_dim() * 4);
    gd.core_out = rows(p.gdn_core_out, c.gdn_v_heads * c.gdn_v_dim * 4);
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

  // The layer's MoE block on the post-attention-normed rows: the router and shared-expert gate logits, then the
  // routed and shared experts adding into `hidden`.
  void moe_block(const std::string& pre) {
    const std::string m = pre + "mlp.";
    ops::MoePrefillSpans mo;
    mo.x = normed;
    mo.router_logits = rows(p.router, c.num_experts * 4);
    mo.shared_gate_logit = rows(p.shared_gate_logit, 4);
    // The router and shared-expert gate logits in f32 whatever the activation dtype.
    ops::qmatmul(ctx, m + "gate", normed, weight(w, m + "gate.weight"), mo.router_logits, T, DType::F32);
    ops::qmatmul(ctx, m + "shared_expert_gate", normed, weight(w, m + "shared_expert_gate.weight"),
                 mo.shared_gate_logit, T, DType::F32);
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
};

}  // namespace

void build_prefill_chunk(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
                         const DecodeBuffers& state, const PrefillBuffers& p, size_t position, size_t T,
                         size_t logit_rows, Graph& g) {
  PrefillChunk chunk(c, precision, sw, w, state, p, position, T, g);
  const size_t a = chunk.a, H = chunk.H;
  ops::embedding(chunk.ctx, chunk.rows(p.ids, 4), 0, weight(w, "embed_tokens.weight"), chunk.hidden, T);
  for (size_t i = 0; i < c.num_layers(); ++i) {
    const std::string pre = layer_prefix(i);
    ops::rms_norm(chunk.ctx, pre + "input_layernorm", chunk.hidden, weight(w, pre + "input_layernorm.weight"),
                  chunk.normed, T, H, c.eps);
    if (c.attention_layers[i]) {
      chunk.attention_mixer(i, pre);
    } else {
      chunk.deltanet_mixer(i, pre);
    }
    ops::rms_norm_residual(chunk.ctx, pre + "post_attention_layernorm", chunk.mixer_out, chunk.hidden,
                           weight(w, pre + "post_attention_layernorm.weight"), chunk.normed, chunk.hidden, T, H, c.eps);
    chunk.moe_block(pre);
  }
  if (logit_rows == 0) return;
  if (logit_rows > T || logit_rows > p.max_logit_rows) {
    throw std::logic_error("[graph] more logit rows than the chunk or its logits buffer has");
  }
  // Only the rows whose logits are asked for (normally the last) go through the final norm and lm_head.
  const Span last_hidden = ops::sub(chunk.hidden, (T - logit_rows) * H * a, logit_rows * H * a);
  const Span last_normed = ops::sub(chunk.normed, 0, logit_rows * H * a);
  ops::rms_norm(chunk.ctx, "norm", last_hidden, weight(w, "norm.weight"), last_normed, logit_rows, H, c.eps);
  ops::qmatmul(chunk.ctx, "lm_head", last_normed, weight(w, "lm_head.weight"),
               Span{p.logits, 0, logit_rows * c.vocab_size * 4}, logit_rows, DType::F32);
}

void host_moe_sort(const HostMoeSort& s, const uint32_t* ids, uint32_t* expert_offsets, uint32_t* tile_map,
                   uint32_t* tile_count, uint32_t* sorted_pairs) {
  std::vector<uint32_t> counts(s.experts, 0);
  for (size_t p = 0; p < s.pairs; ++p) {
    if (ids[p] >= s.experts) {
      throw Error("[engine] MoE routing wrote expert id " + std::to_string(ids[p]) + " for pair " +
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

}  // namespace lily
