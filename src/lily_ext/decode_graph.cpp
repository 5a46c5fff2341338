// The decode step's graph: one token through every layer, lm_head and the token choice (see model.h).
#include "model.h"

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

namespace {

// One decode step under construction: what its dispatches share (configuration, switches, weights, buffers, the op
// context and the hidden-stream spans), and the pieces build_decode_step puts together, one method each.
struct DecodeStep {
  const ModelConfig& c;
  const Switches& sw;
  const WeightTable& w;
  const DecodeBuffers& b;
  Graph& g;
  size_t position;
  DType act;
  size_t a, H;
  ops::Context ctx;
  // With fusion on, every RMSNorm of the hidden stream is folded into the GEMV(s) reading it (qmv_norm: each
  // simdgroup recomputes the row's sum of squares), the residual adds into the out/o projection (qmv_residual), and
  // moe_route with the post-attention norm into the experts' gate/up kernel: 6 dispatches per DeltaNet layer, 7 per
  // attention layer (short context), each depending on the one before.
  bool fuse;
  Span hidden, normed, mixer_out, proj;

  DecodeStep(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
             const DecodeBuffers& b, size_t position, Graph& g)
      : c(c), sw(sw), w(w), b(b), g(g), position(position),
        act(precision == Precision::Float32 ? DType::F32 : DType::BF16), a(dtype_size(act)), H(c.hidden_size),
        ctx{g, act, !sw.concurrent, sw.wide_tiles}, fuse(sw.fusion), hidden(whole(g, b.hidden)),
        normed(whole(g, b.normed)), mixer_out(whole(g, b.mixer_out)), proj(whole(g, b.proj)) {
    ctx.gqa_packing = sw.gqa_packing;
    ctx.coalesced_kv = sw.coalesced_kv;
    ctx.staged_gemv = sw.staged_gemv;
  }

  // `norm` (rms_norm(x) ⊙ norm, written to `normed`) in front of the GEMVs that read it: its own dispatch, or folded.
  Span normalise(const std::string& label, const WeightRef& norm) {
    if (fuse) return hidden;
    ops::rms_norm(ctx, label, hidden, norm, normed, 1, H, c.eps);
    return normed;
  }

  void gemv(const std::string& label, const Span& x, const WeightRef& m, const Span& out, DType dtype,
            const WeightRef& norm) {
    if (fuse) {
      ops::qmatmul_norm(ctx, label, x, norm, m, out, c.eps, dtype);
    } else {
      ops::qmatmul(ctx, label, x, m, out, 1, dtype);
    }
  }

  // Projections sharing an input: one segmented GEMV reading each matrix's own (mapped) bytes, or one GEMV per
  // matrix; either way each writes its slice of the same output.
  void projections(const std::string& label, const std::vector<std::string>& parts, const Span& x, const Span& out,
                   DType dtype, bool use_fused, const WeightRef& norm) {
    if (use_fused) {
      std::vector<const WeightRef*> refs;
      size_t rows = 0;
      for (const std::string& name : parts) {
        refs.push_back(&weight(w, name));
        rows += refs.back()->rows;
      }
      // Matrices quantized differently (a mixed-bit checkpoint) cannot share one kernel: one GEMV each, below.
      if (ops::quantized_alike(refs)) {
        ops::qmatmul_segments(ctx, label, x, fuse ? &norm : nullptr, refs, parts,
                              ops::sub(out, 0, rows * dtype_size(dtype)), c.eps, dtype);
        return;
      }
    }
    size_t offset = 0;
    for (const std::string& name : parts) {
      const WeightRef& p = weight(w, name);
      gemv(name, x, p, ops::sub(out, offset, p.rows * dtype_size(dtype)), dtype, norm);
      offset += p.rows * dtype_size(dtype);
    }
  }

  // The out/o projection: hidden += W · x in one GEMV, or into mixer_out (the residual add comes with the next norm).
  void out_projection(const std::string& label, const Span& x, const WeightRef& m) {
    if (fuse) {
      ops::qmatmul_residual(ctx, label, x, m, hidden);
    } else {
      ops::qmatmul(ctx, label, x, m, mixer_out, 1, act);
    }
  }

  // Layer i's mixer when it is full attention: q (with its gate), k and v from one projection's slices, attention
  // over the cache (split over key blocks once the context is long enough), then o_proj.
  void attention_mixer(size_t i, const std::string& p, const Span& mixer_in, const WeightRef& input_norm) {
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
    ops::attention_decode(ctx, c, p + "attention", at, position, ops::attention_split_blocks(sw, position + 1));
    out_projection(s + "o_proj", at.out, weight(w, s + "o_proj.weight"));
  }

  // Layer i's mixer when it is a Gated DeltaNet: qkv, z, b and a from one projection's slices, one recurrent step
  // (conv and recurrent state in place), then out_proj.
  void deltanet_mixer(size_t i, const std::string& p, const Span& mixer_in, const WeightRef& input_norm) {
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

  // The layer's MoE block after its mixer: the residual add and post-attention norm (unless folded), the router and
  // shared-expert gate logits, then the routed and shared experts adding into the hidden stream.
  void moe_block(const std::string& p) {
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
};

}  // namespace

void build_decode_step(const ModelConfig& c, Precision precision, const Switches& sw, const WeightTable& w,
                       const DecodeBuffers& b, size_t position, int token_slot, int next_slot, Graph& g,
                       const std::optional<TokenChoice>& choice) {
  DecodeStep step(c, precision, sw, w, b, position, g);
  ops::embedding(step.ctx, whole(g, b.tokens), static_cast<size_t>(token_slot), weight(w, "embed_tokens.weight"),
                 step.hidden, 1);
  for (size_t i = 0; i < c.num_layers(); ++i) {
    const std::string p = layer_prefix(i);
    const WeightRef& input_norm = weight(w, p + "input_layernorm.weight");
    const Span mixer_in = step.normalise(p + "input_layernorm", input_norm);
    if (c.attention_layers[i]) {
      step.attention_mixer(i, p, mixer_in, input_norm);
    } else {
      step.deltanet_mixer(i, p, mixer_in, input_norm);
    }
    step.moe_block(p);
  }
  const WeightRef& final_norm = weight(w, "norm.weight");
  Span logits = whole(g, b.logits);
  // Logits in f32 in every precision: rounded to bf16 (8 bits of mantissa), near-equal logits tie and the argmax
  // picks between them by index.
  step.gemv("lm_head", step.normalise("norm", final_norm), weight(w, "lm_head.weight"), logits, DType::F32,
            final_norm);
  if (sw.gpu_token && choice) {
    build_token_choice(c, *choice, b, position, 1, next_slot, g);  // the token at position + 1
  }
}

void build_token_choice(const ModelConfig& c, const TokenChoice& choice, const DecodeBuffers& b, size_t position,
                        int position_delta, int out_slot, Graph& g) {
  // The logits are f32 in every precision, and so is every kernel of the choice.
  ops::Context ctx{g, DType::F32, false};
  Span logits = whole(g, b.logits);
  const Span tokens = whole(g, b.tokens), seen = whole(g, b.seen_tokens), counts = whole(g, b.token_counts);
  if (choice.penalized()) {
    ops::penalize_logits(ctx, logits, c.vocab_size, choice, whole(g, b.logit_bias), seen, counts,
                         whole(g, b.penalized_logits));
    logits = whole(g, b.penalized_logits);
  }
  if (choice.temperature == 0.0f) {
    ops::argmax(ctx, logits, c.vocab_size, whole(g, b.argmax_values), whole(g, b.argmax_ids), tokens,
                static_cast<size_t>(out_slot));
  } else {
    ops::sample(ctx, logits, c.vocab_size, choice, whole(g, b.argmax_values), whole(g, b.argmax_ids), tokens,
                static_cast<size_t>(out_slot), position, position_delta);
  }
  if (choice.penalized()) ops::count_token(ctx, c.vocab_size, tokens, static_cast<size_t>(out_slot), seen, counts);
}

}  // namespace lily
