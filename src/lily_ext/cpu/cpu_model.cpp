// CpuModel: binding checks, then reference.forward op by op on the CPU ops (cpu_ops.h).
#include "cpu_model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "../model.h"

namespace lily::cpu {

struct CpuModel::Buffer {
  const uint8_t* data = nullptr;
  size_t size = 0;
  void* mapping = nullptr;  // munmap'd on destruction when set
  std::vector<uint8_t> owned;
  ~Buffer() {
    if (mapping) munmap(mapping, size);
  }
};

struct CpuModel::AttentionWeights {
  const Matrix *q_proj, *k_proj, *v_proj, *o_proj;
  const std::vector<float>*q_norm, *k_norm;
};

struct CpuModel::DeltaNetWeights {
  const Matrix *in_proj_qkv, *in_proj_z, *in_proj_b, *in_proj_a, *out_proj;
  const std::vector<float>*conv, *dt_bias, *a_log, *norm;
};

struct CpuModel::MoeWeights {
  const Matrix *router, *gate_proj, *up_proj, *down_proj;
  const Matrix *shared_gate_proj, *shared_up_proj, *shared_down_proj, *shared_expert_gate;
};

struct CpuModel::Layer {
  bool attention = false;
  const std::vector<float>*input_norm = nullptr, *post_norm = nullptr;
  AttentionWeights attn{};
  DeltaNetWeights gdn{};
  MoeWeights moe{};
};

DType dtype_from_name(const std::string& name) {
  if (name == "float32") return DType::F32;
  if (name == "bfloat16") return DType::BF16;
  if (name == "float16") return DType::F16;
  throw std::invalid_argument("unsupported dtype '" + name + "': expected float32, bfloat16 or float16");
}

CpuConfig cpu_config(const ModelConfig& config, std::vector<float> inv_freq) {
  CpuConfig c;
  c.vocab_size = config.vocab_size;
  c.hidden_size = config.hidden_size;
  c.attention_layers = config.attention_layers;
  c.attention = {config.num_heads, config.num_kv_heads, config.head_dim, config.rotary_dim};
  c.delta_net = {config.gdn_k_heads, config.gdn_v_heads, config.gdn_k_dim, config.gdn_v_dim, config.conv_kernel};
  c.num_experts = config.num_experts;
  c.top_k = config.top_k;
  c.expert_size = config.expert_size;
  c.shared_expert_size = config.shared_expert_size;
  c.eps = config.eps;
  c.inv_freq = std::move(inv_freq);
  return c;
}

CpuModel::CpuModel(CpuConfig config, size_t threads) : config_(std::move(config)), pool_(std::max<size_t>(threads, 1)) {
  const AttentionShape& a = config_.attention;
  const DeltaNetShape& d = config_.delta_net;
  if (a.kv_heads == 0 || a.heads % a.kv_heads)
    throw std::invalid_argument("num_attention_heads must be a multiple of num_key_value_heads");
  if (d.k_heads == 0 || d.v_heads % d.k_heads)
    throw std::invalid_argument("linear_num_value_heads must be a multiple of linear_num_key_heads");
  if (config_.inv_freq.size() != a.rotary_dim / 2)
    throw std::invalid_argument("inv_freq must hold rotary_dim / 2 values");
  if (config_.top_k == 0 || config_.top_k > config_.num_experts)
    throw std::invalid_argument("num_experts_per_tok must be in [1, num_experts]");
}

CpuModel::~CpuModel() = default;

size_t CpuModel::add_file(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::invalid_argument(path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  fstat(fd, &st);
  auto buffer = std::make_unique<Buffer>();
  buffer->size = size_t(st.st_size);
  if (buffer->size) {
    void* mapping = mmap(nullptr, buffer->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      close(fd);
      throw std::invalid_argument(path + ": cannot map (" + std::strerror(errno) + ")");
    }
    buffer->mapping = mapping;
    buffer->data = static_cast<const uint8_t*>(mapping);
  }
  close(fd);
  buffers_.push_back(std::move(buffer));
  return buffers_.size() - 1;
}

size_t CpuModel::add_owned(const uint8_t* data, size_t bytes) {
  auto buffer = std::make_unique<Buffer>();
  buffer->owned.assign(data, data + bytes);
  buffer->data = buffer->owned.data();
  buffer->size = bytes;
  owned_bytes_ += bytes;
  buffers_.push_back(std::move(buffer));
  return buffers_.size() - 1;
}

const uint8_t* CpuModel::bytes(const std::string& name, const char* part, Span span, size_t expected) const {
  if (span.buffer >= buffers_.size()) throw std::invalid_argument(name + ": " + part + " names no bound buffer");
  const Buffer& b = *buffers_[span.buffer];
  if (span.bytes != expected)
    throw std::invalid_argument(name + ": " + part + " holds " + std::to_string(span.bytes) +
                                " bytes; its shape needs " + std::to_string(expected));
  if (span.offset > b.size || b.size - span.offset < span.bytes)
    throw std::invalid_argument(name + ": " + part + " runs past the end of its file");
  return b.data + span.offset;
}

void CpuModel::bind_matrix(const std::string& name, int bits, int group, DType dtype, size_t experts, size_t rows,
                           size_t cols, Span data, Span scales, Span biases) {
  Matrix m;
  m.bits = bits;
  m.group = group;
  m.dtype = dtype;
  m.experts = experts;
  m.rows = rows;
  m.cols = cols;
  const size_t stack = std::max<size_t>(experts, 1);
  if (bits) {
    if (bits != 2 && bits != 4 && bits != 8)
      throw std::invalid_argument(name + ": " + std::to_string(bits) + "-bit weights are not supported (2, 4 or 8)");
    if (group != 32 && group != 64 && group != 128)
      throw std::invalid_argument(name + ": group size " + std::to_string(group) +
                                  " is not supported (32, 64 or 128)");
    if (cols % group)
      throw std::invalid_argument(name + ": " + std::to_string(cols) + " columns are not a multiple of the group size");
    const size_t scale_bytes = stack * rows * (cols / group) * m.scale_bytes();
    m.scales = bytes(name, "scales", scales, scale_bytes);
    m.biases = bytes(name, "biases", biases, scale_bytes);
  }
  m.data = bytes(name, "weight", data, stack * rows * m.row_bytes());
  matrices_[name] = m;
}

void CpuModel::bind_vector(const std::string& name, std::vector<float> values) { vectors_[name] = std::move(values); }

const Matrix& CpuModel::matrix(const std::string& name, size_t rows, size_t cols, size_t experts) const {
  auto it = matrices_.find(name);
  if (it == matrices_.end()) throw std::invalid_argument("checkpoint has no tensor " + name);
  const Matrix& m = it->second;
  if (m.rows != rows || m.cols != cols || m.experts != experts)
    throw std::invalid_argument(name + ": shape [" + (m.experts ? std::to_string(m.experts) + ", " : "") +
                                std::to_string(m.rows) + ", " + std::to_string(m.cols) + "] where the config needs [" +
                                (experts ? std::to_string(experts) + ", " : "") + std::to_string(rows) + ", " +
                                std::to_string(cols) + "]");
  return m;
}

const std::vector<float>& CpuModel::vector(const std::string& name, size_t size) const {
  auto it = vectors_.find(name);
  if (it == vectors_.end()) throw std::invalid_argument("checkpoint has no tensor " + name);
  if (it->second.size() != size)
    throw std::invalid_argument(name + ": " + std::to_string(it->second.size()) + " values where the config needs " +
                                std::to_string(size));
  return it->second;
}

void CpuModel::finish_loading() {
  const CpuConfig& c = config_;
  const AttentionShape& a = c.attention;
  const DeltaNetShape& d = c.delta_net;
  const size_t H = c.hidden_size;
  embed_tokens_ = &matrix("embed_tokens.weight", c.vocab_size, H);
  lm_head_ = &matrix("lm_head.weight", c.vocab_size, H);
  final_norm_ = &vector("norm.weight", H);
  layers_.clear();
  for (size_t i = 0; i < c.attention_layers.size(); ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer l;
    l.attention = c.attention_layers[i];
    l.input_norm = &vector(p + "input_layernorm.weight", H);
    l.post_norm = &vector(p + "post_attention_layernorm.weight", H);
    if (l.attention) {
      const std::string s = p + "self_attn.";
      l.attn = {&matrix(s + "q_proj.weight", 2 * a.heads * a.head_dim, H),
                &matrix(s + "k_proj.weight", a.kv_heads * a.head_dim, H),
                &matrix(s + "v_proj.weight", a.kv_heads * a.head_dim, H),
                &matrix(s + "o_proj.weight", H, a.heads * a.head_dim),
                &vector(s + "q_norm.weight", a.head_dim),
                &vector(s + "k_norm.weight", a.head_dim)};
    } else {
      const std::string s = p + "linear_attn.";
      l.gdn = {&matrix(s + "in_proj_qkv.weight", d.conv_dim(), H),
               &matrix(s + "in_proj_z.weight", d.value_dim(), H),
               &matrix(s + "in_proj_b.weight", d.v_heads, H),
               &matrix(s + "in_proj_a.weight", d.v_heads, H),
               &matrix(s + "out_proj.weight", H, d.value_dim()),
               &vector(s + "conv1d.weight", d.conv_dim() * d.conv_kernel),
               &vector(s + "dt_bias", d.v_heads),
               &vector(s + "A_log", d.v_heads),
               &vector(s + "norm.weight", d.v_dim)};
    }
    const std::string m = p + "mlp.";
    l.moe = {&matrix(m + "gate.weight", c.num_experts, H),
             &matrix(m + "switch_mlp.gate_proj.weight", c.expert_size, H, c.num_experts),
             &matrix(m + "switch_mlp.up_proj.weight", c.expert_size, H, c.num_experts),
             &matrix(m + "switch_mlp.down_proj.weight", H, c.expert_size, c.num_experts),
             &matrix(m + "shared_expert.gate_proj.weight", c.shared_expert_size, H),
             &matrix(m + "shared_expert.up_proj.weight", c.shared_expert_size, H),
             &matrix(m + "shared_expert.down_proj.weight", H, c.shared_expert_size),
             &matrix(m + "shared_expert_gate.weight", 1, H)};
    layers_.push_back(l);
  }
  expert_tokens_.assign(layers_.size() * c.num_experts, 0);
}

void CpuModel::attention_layer(const Layer& layer, const float* x, size_t tokens, size_t position,
                               const LayerState& state, float* out) {
  const AttentionShape& s = config_.attention;
  const AttentionWeights& w = layer.attn;
  const size_t d = s.head_dim, kv_row = s.kv_heads * d;
  if (state.first_size < (position + tokens) * kv_row || state.second_size != state.first_size)
    throw std::invalid_argument("KV cache is smaller than position + tokens rows");
  Scratch q_and_gate(tokens * 2 * s.heads * d), q(tokens * s.heads * d), gate(q.size()), att(q.size());
  float* keys = state.first;
  float* values = state.second;
  linear_many(x, tokens,
              {{w.q_proj, q_and_gate.data()}, {w.k_proj, keys + position * kv_row},
               {w.v_proj, values + position * kv_row}},
              &pool_);
  pool_.for_items(tokens, (2 * s.heads + s.kv_heads) * d * 4, [&](size_t t0, size_t t1) {
    const size_t q_row = s.heads * d;
    attention_prep(q_and_gate.data() + t0 * 2 * q_row, keys + (position + t0) * kv_row, s, t1 - t0,
                   w.q_norm->data(), w.k_norm->data(), config_.inv_freq.data(), position + t0, config_.eps,
                   q.data() + t0 * q_row, gate.data() + t0 * q_row);
  });
  attention(q.data(), keys, values, gate.data(), s, tokens, position, att.data(), &pool_);
  linear(att.data(), tokens, *w.o_proj, out, &pool_);
}

void CpuModel::delta_net_layer(const Layer& layer, const float* x, size_t tokens, const LayerState& state, float* out) {
  const DeltaNetShape& s = config_.delta_net;
  const DeltaNetWeights& w = layer.gdn;
  const size_t channels = s.conv_dim();
  if (state.first_size != (s.conv_kernel - 1) * channels || state.second_size != s.v_heads * s.k_dim * s.v_dim)
    throw std::invalid_argument("DeltaNet state has the wrong size for this model");
  Scratch mixed(tokens * channels), z(tokens * s.value_dim()), b(tokens * s.v_heads), a(b.size());
  linear_many(x, tokens,
              {{w.in_proj_qkv, mixed.data()}, {w.in_proj_z, z.data()}, {w.in_proj_b, b.data()},
               {w.in_proj_a, a.data()}},
              &pool_);
  causal_conv1d(mixed.data(), tokens, channels, s.conv_kernel, w.conv->data(), state.first, &pool_);
  const float q_scale = float(1.0 / std::sqrt(double(s.k_dim)));
  pool_.for_items(tokens, 4 * s.key_dim(), [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) {
      l2_normalize(mixed.data() + t * channels, s.k_heads, s.k_dim, q_scale);
      l2_normalize(mixed.data() + t * channels + s.key_dim(), s.k_heads, s.k_dim, 1.0f);
    }
  });
  // beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), the log-decay.
  for (size_t t = 0; t < tokens; ++t)
    for (size_t h = 0; h < s.v_heads; ++h) {
      const size_t i = t * s.v_heads + h;
      const double u = double(a[i] + (*w.dt_bias)[h]);
      const float softplus = float(u > 0 ? u + std::log1p(std::exp(-u)) : std::log1p(std::exp(u)));
      b[i] = sigmoid(b[i]);
      a[i] = -std::exp((*w.a_log)[h]) * softplus;
    }
  Scratch o(tokens * s.value_dim()), y(o.size());
  gated_delta_rule(mixed.data(), a.data(), b.data(), s, tokens, state.second, o.data(), &pool_);
  pool_.for_items(tokens * s.v_heads, s.v_dim * 8, [&](size_t r0, size_t r1) {
    gated_rms_norm(o.data() + r0 * s.v_dim, z.data() + r0 * s.v_dim, r1 - r0, s.v_dim, w.norm->data(), config_.eps,
                   y.data() + r0 * s.v_dim);
  });
  linear(y.data(), tokens, *w.out_proj, out, &pool_);
}

void CpuModel::moe_layer(const Layer& layer, const float* x, size_t tokens, float* out) {
  const CpuConfig& c = config_;
  const MoeWeights& w = layer.moe;
  const size_t H = c.hidden_size, k = c.top_k, width = c.shared_expert_size;
  Scratch router(tokens * c.num_experts), routing_weights(tokens * k);
  Scratch gate(tokens * width), up(gate.size()), shared(tokens * H), shared_gate(tokens);
  std::vector<int32_t> indices(tokens * k);
  // Every projection of x at once; the shared expert's are used after the routed experts.
  linear_many(x, tokens,
              {{w.router, router.data()}, {w.shared_expert_gate, shared_gate.data()},
               {w.shared_gate_proj, gate.data()}, {w.shared_up_proj, up.data()}},
              &pool_);
  moe_route(router.data(), tokens, c.num_experts, k, indices.data(), routing_weights.data());
  uint64_t* load = expert_tokens_.data() + size_t(&layer - layers_.data()) * c.num_experts;
  for (const int32_t expert : indices) ++load[expert];
  swiglu_experts(x, tokens, H, *w.gate_proj, *w.up_proj, *w.down_proj, indices.data(), routing_weights.data(), k,
                 out, &pool_);
  pool_.for_items(gate.size(), 8, [&](size_t i0, size_t i1) { silu(gate.data() + i0, up.data() + i0, i1 - i0); });
  linear(gate.data(), tokens, *w.shared_down_proj, shared.data(), &pool_);
  for (size_t t = 0; t < tokens; ++t) {
    const float g = sigmoid(shared_gate[t]);
    for (size_t i = 0; i < H; ++i) out[t * H + i] += g * shared[t * H + i];
  }
}

void CpuModel::norm_rows(const float* x, size_t rows, const std::vector<float>& w, float* out) {
  const size_t n = w.size();
  pool_.for_items(rows, 4 * n, [&](size_t r0, size_t r1) {
    rms_norm(x + r0 * n, r1 - r0, n, w.data(), config_.eps, out + r0 * n);
  });
}

void CpuModel::forward(const int64_t* ids, size_t tokens, size_t position, const std::vector<LayerState>& states,
                       float* logits, bool last_only) {
  const CpuConfig& c = config_;
  const size_t H = c.hidden_size;
  if (layers_.empty()) throw std::logic_error("finish_loading() was not called");
  if (states.size() != layers_.size()) throw std::invalid_argument("state has the wrong number of layers");
  for (size_t i = 0; i < tokens; ++i)
    if (ids[i] < 0 || size_t(ids[i]) >= c.vocab_size) throw std::invalid_argument("token id out of range");
  Scratch h(tokens * H), normed(h.size()), mixed(h.size());
  embed(ids, tokens, *embed_tokens_, h.data());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    norm_rows(h.data(), tokens, *layer.input_norm, normed.data());
    if (layer.attention) attention_layer(layer, normed.data(), tokens, position, states[l], mixed.data());
    else delta_net_layer(layer, normed.data(), tokens, states[l], mixed.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += mixed[i];
    norm_rows(h.data(), tokens, *layer.post_norm, normed.data());
    moe_layer(layer, normed.data(), tokens, mixed.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += mixed[i];
  }
  const size_t first = last_only ? tokens - 1 : 0, rows = tokens - first;
  norm_rows(h.data() + first * H, rows, *final_norm_, normed.data());
  linear(normed.data(), rows, *lm_head_, logits, &pool_);
}

}  // namespace lily::cpu
