// The graph's types, the model configuration check, synthetic weights and the decode state buffers (see model.h).
#include "model.h"

#include <algorithm>

#include "../../metal/lily.h"
#include "ops/ops.h"
#include "graph_build.h"
#include "tuning.h"

namespace lily {

using graph::layer_prefix;

namespace {

[[noreturn]] void bad_config(const std::string& field, const std::string& why) {
  throw Error("[engine] config field " + field + ": " + why);
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

void ModelConfig::validate() const {
  auto positive = [](size_t v, const char* field) {
    if (v == 0) bad_config(field, "must be positive");
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_layers(), "layer_types");
  positive(num_experts, "num_experts");
  positive(top_k, "num_experts_per_tok");
  auto got = [](size_t v) { return "; got " + std::to_string(v); };
  if (hidden_size % 64) bad_config("hidden_size", "must be a multiple of 64 (quantization group)" + got(hidden_size));
  if (num_experts > LILY_MOE_MAX_EXPERTS) {
    bad_config("num_experts", "at most " + std::to_string(LILY_MOE_MAX_EXPERTS) + got(num_experts));
  }
  if (top_k > num_experts) bad_config("num_experts_per_tok", "at most num_experts");
  if (expert_size % 64) bad_config("moe_intermediate_size", "must be a multiple of 64" + got(expert_size));
  if (shared_expert_size % 64) {
    bad_config("shared_expert_intermediate_size", "must be a multiple of 64" + got(shared_expert_size));
  }
  if (gdn_k_heads == 0 || gdn_v_heads % gdn_k_heads) bad_config("linear_num_value_heads", "must be a multiple of linear_num_key_heads");
  if (num_kv_heads == 0 || num_heads % num_kv_heads) bad_config("num_attention_heads", "must be a multiple of num_key_value_heads");
}

void ModelConfig::check_kernel_shapes() const {
  bool any_attention = std::find(attention_layers.begin(), attention_layers.end(), true) != attention_layers.end();
  bool any_gdn = std::find(attention_layers.begin(), attention_layers.end(), false) != attention_layers.end();
  if (any_attention) ops::check_attention_shapes(*this);  // head dims 256 and 64
  if (any_gdn) {
    ops::check_gated_delta_shapes(*this);  // key head dims 128 and 64
    if (gdn_v_heads / gdn_k_heads > LILY_GDN_MAX_HEADS_PER_GROUP) {
      bad_config("linear_num_value_heads", "the DeltaNet kernels are built for at most " +
                                               std::to_string(LILY_GDN_MAX_HEADS_PER_GROUP) +
                                               " value heads per key head; got " + std::to_string(gdn_v_heads) + " / " +
                                               std::to_string(gdn_k_heads));
    }
    if ((gdn_v_heads / gdn_k_heads) * gdn_v_dim > LILY_GDN_MAX_ROWS) {
      bad_config("linear_value_head_dim", "(Hv/Hk) x dv must be at most 256; got (" + std::to_string(gdn_v_heads) + "/" +
                                              std::to_string(gdn_k_heads) + ") x " + std::to_string(gdn_v_dim));
    }
    if (conv_kernel != LILY_GDN_CONV_KERNEL) {
      bad_config("linear_conv_kernel_dim", "the DeltaNet kernels are built for 4; got " + std::to_string(conv_kernel));
    }
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
  // Split-KV partials for the most blocks any split_kv_min_keys (>= 1) picks up to max_keys.
  const size_t max_blocks = std::max<size_t>(1, tuning::attention_split_blocks(max_keys, 1));
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
  b.logits = g.add_buffer("logits", c.vocab_size * 4, BufferRole::Io);  // f32 in every precision
  // The token choice's scratch: argmax partials, or the sampling block path's candidates and block statistics.
  const size_t choice_words = std::max(partials, ops::sample_scratch_words(c.vocab_size));
  b.argmax_values = g.add_buffer("argmax values", choice_words * 4, BufferRole::Scratch);
  b.argmax_ids = g.add_buffer("argmax ids", choice_words * 4, BufferRole::Scratch);
  b.tokens = g.add_buffer("tokens", 2 * 4, BufferRole::Io);  // two GPU token slots, alternating
  // lily.sampling steps 1-3 on the GPU (penalized requests only): host-written bias and seen-token tables, the
  // counts count_token keeps, and the processed fp32 logits the choice then reads.
  b.logit_bias = g.add_buffer("logit bias", c.vocab_size * 4, BufferRole::Io);
  b.seen_tokens = g.add_buffer("seen tokens", c.vocab_size * 4, BufferRole::Io);
  b.token_counts = g.add_buffer("token counts", c.vocab_size * 4, BufferRole::Io);
  b.penalized_logits = g.add_buffer("penalized logits", c.vocab_size * 4, BufferRole::Scratch);
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

void DeviceMemory::add(const DecodeBuffers& decode, int id, BufferRole role, uint64_t bytes) {
  const auto holds = [id](const std::vector<int>& ids) { return std::find(ids.begin(), ids.end(), id) != ids.end(); };
  const bool kv = holds(decode.k_cache) || holds(decode.v_cache);
  (kv                            ? kv_cache
   : role == BufferRole::Weights ? weights
   : role == BufferRole::State   ? state
                                 : scratch) += bytes;
}

}  // namespace lily
