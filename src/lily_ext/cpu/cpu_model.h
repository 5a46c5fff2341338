// The CPU backend's model: weights bound by name onto memory-mapped checkpoint bytes, and one forward pass over
// an explicit state (reference.forward, op by op, on the ops of cpu_ops.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cpu_ops.h"

namespace lily {
struct ModelConfig;  // model.h
}

namespace lily::cpu {

struct CpuConfig {
  size_t vocab_size = 0, hidden_size = 0;
  std::vector<bool> attention_layers;  // true: full attention, false: Gated DeltaNet
  AttentionShape attention{};
  DeltaNetShape delta_net{};
  size_t num_experts = 0, top_k = 0, expert_size = 0, shared_expert_size = 0;
  float eps = 1e-6f;
  std::vector<float> inv_freq;  // RoPE frequencies, rotary_dim / 2 of them
};

// The CPU engine's view of the engines' one configuration (lily._ext.ModelConfig): the same shapes, and the RoPE
// frequencies lily.reference.rope_inv_freq formed (the reference's own, not a second implementation of it).
CpuConfig cpu_config(const ModelConfig& config, std::vector<float> inv_freq);

// A byte range of a bound buffer: {buffer id, offset, bytes}.
struct Span {
  size_t buffer = 0, offset = 0, bytes = 0;
};

// One layer's state, owned by the caller: attention {keys, values} [capacity, Hkv, D]; DeltaNet {conv [K-1, C],
// recurrent [Hv, dk, dv]}; `capacity` rows of keys/values.
struct LayerState {
  float* first = nullptr;
  float* second = nullptr;
  size_t first_size = 0, second_size = 0;
};

class CpuModel {
 public:
  CpuModel(CpuConfig config, size_t threads);
  ~CpuModel();
  CpuModel(const CpuModel&) = delete;
  CpuModel& operator=(const CpuModel&) = delete;

  // A checkpoint file, mapped read-only; returns its buffer id.
  size_t add_file(const std::string& path);
  // Bytes the model keeps (weights that are not one byte range of a file in a usable dtype).
  size_t add_owned(const uint8_t* data, size_t bytes);
  size_t owned_bytes() const { return owned_bytes_; }
  // A matrix or expert stack: bits 0 is dense in `dtype`; else quantized with `dtype` scales and biases.
  void bind_matrix(const std::string& name, int bits, int group, DType dtype, size_t experts, size_t rows,
                   size_t cols, Span data, Span scales, Span biases);
  // A small dense tensor (norm weights, conv taps, A_log, dt_bias), kept as float32.
  void bind_vector(const std::string& name, std::vector<float> values);
  // Checks that every tensor the graph reads is bound with the right shape; names the first one missing.
  void finish_loading();

  // Runs `tokens` ids after `position` tokens; advances `layers` in place. logits: [tokens, V], or [1, V] of the
  // last token when last_only.
  void forward(const int64_t* ids, size_t tokens, size_t position, const std::vector<LayerState>& layers,
               float* logits, bool last_only);

  size_t threads() const { return pool_.size(); }
  const CpuConfig& config() const { return config_; }
  // Routed (token, slot) pairs per [layer * num_experts + expert] since finish_loading() or the last reset: the
  // expert load `lily bench` reports for dummy weights.
  const std::vector<uint64_t>& expert_tokens() const { return expert_tokens_; }
  void reset_expert_tokens() { std::fill(expert_tokens_.begin(), expert_tokens_.end(), 0); }

 private:
  struct Buffer;
  struct AttentionWeights;
  struct DeltaNetWeights;
  struct MoeWeights;
  struct Layer;

  const uint8_t* bytes(const std::string& name, const char* part, Span span, size_t expected) const;
  const Matrix& matrix(const std::string& name, size_t rows, size_t cols, size_t experts = 0) const;
  const std::vector<float>& vector(const std::string& name, size_t size) const;

  void attention_layer(const Layer& layer, const float* x, size_t tokens, size_t position, const LayerState& state,
                       float* out);
  void delta_net_layer(const Layer& layer, const float* x, size_t tokens, const LayerState& state, float* out);
  void moe_layer(const Layer& layer, const float* x, size_t tokens, float* out);
  // RMSNorm of `rows` rows of w.size() values, rows spread over the threads.
  void norm_rows(const float* x, size_t rows, const std::vector<float>& w, float* out);

  CpuConfig config_;
  ThreadPool pool_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  size_t owned_bytes_ = 0;
  std::map<std::string, Matrix> matrices_;
  std::map<std::string, std::vector<float>> vectors_;
  std::vector<Layer> layers_;
  std::vector<uint64_t> expert_tokens_;
  const Matrix* embed_tokens_ = nullptr;
  const Matrix* lm_head_ = nullptr;
  const std::vector<float>* final_norm_ = nullptr;
};

DType dtype_from_name(const std::string& name);

}  // namespace lily::cpu
