// The CPU runtime's ops (backend="cpu"): the maths of python/lily/reference.py, in C++ on the packed checkpoint
// weights, behind the kernels of kernels.h. One op family per file, named as the reference function and the Metal
// kernel family it mirrors: qmatmul.cpp (linear, embedding), rms_norm.cpp, attention.cpp, gated_delta.cpp, moe.cpp;
// thread_pool.cpp runs them on a few threads. Portable C++17 (g++ or clang); AVX2/FMA (and AVX-512VL) paths are
// chosen at run time (`set_isa`, isa.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace lily::cpu {

// Floats that are written before they are read: std::vector<float>(n) without the zeroing (megabytes per layer in a
// prefill).
class Scratch {
 public:
  explicit Scratch(size_t n) : data_(new float[n]), size_(n) {}
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  size_t size() const { return size_; }
  float& operator[](size_t i) { return data_[i]; }
  float operator[](size_t i) const { return data_[i]; }

 private:
  std::unique_ptr<float[]> data_;
  size_t size_;
};

// Storage dtype of dense values, or of the scales and biases of a quantized weight.
enum class DType { F32, BF16, F16 };

float to_float(const uint8_t* values, DType dtype, size_t index);

// One weight: dense [experts?, rows, cols] in `dtype`, or MLX affine quantized (bits 2/4/8, groups of `group`
// elements along a row; codes packed little-endian into uint32 words; value = scale * q + bias).
// Pointers reach into the memory-mapped checkpoint (or a buffer the model owns); nothing is converted at load.
struct Matrix {
  int bits = 0;  // 0: dense
  int group = 0;
  DType dtype = DType::F32;
  size_t experts = 0;  // 0: a plain 2-D matrix
  size_t rows = 0, cols = 0;
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* biases = nullptr;

  size_t row_bytes() const { return bits ? cols * bits / 8 : cols * (dtype == DType::F32 ? 4 : 2); }
  size_t scale_bytes() const { return dtype == DType::F32 ? 4 : 2; }
  // The matrix of one expert of a stack (the matrix itself when experts == 0).
  Matrix expert(size_t e) const;
};

// Runs [0, n) split into contiguous ranges over a small pool of threads (the caller works too).
class ThreadPool {
 public:
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  size_t size() const { return workers_.size() + 1; }
  // fn(begin, end) over `n` items; items are split in up to per_thread * size() ranges, each at least `min_items`
  // long, taken in turn by the threads.
  void parallel_for(size_t n, size_t min_items, const std::function<void(size_t, size_t)>& fn, size_t per_thread = 2);
  // Operations below which a range is not split off: a job costs about a microsecond when the workers spin.
  static constexpr size_t kMinOps = size_t(1) << 13;
  // parallel_for with ranges of at least about kMinOps operations, given the operations per item.
  void for_items(size_t n, size_t work_per_item, const std::function<void(size_t, size_t)>& fn) {
    parallel_for(n, std::max<size_t>(1, kMinOps / std::max<size_t>(work_per_item, 1)), fn);
  }

 private:
  struct Shared;
  Shared* shared_;
  std::vector<std::thread> workers_;
  uint64_t job_ = 0;  // the last job's id
};

// Instruction set of the hot loops: "avx512" (the AVX2 loops, the GEMV's with AVX-512VL's 32 registers: the same sums),
// "avx2" (AVX2 + FMA) or "portable"; by default the widest the CPU has. LILY_CPU_ISA=<name> picks one at start.
void set_isa(const std::string& name);
std::string isa();
bool avx2_enabled();    // avx2 or avx512: the AVX2 loops
bool avx512_enabled();  // avx512: the GEMV's 32-register blockings
// Why LILY_CPU_ISA was not taken at start (it names no instruction set, or one the CPU lacks); "" where it was.
std::string isa_environment_refusal();

// ---- qmatmul.cpp: linear (x @ W^T) ----
// out[t, n] = sum_k x[t, k] W[n, k] for t < T, n < W.rows. Serial when pool is null.
void linear(const float* x, size_t tokens, const Matrix& w, float* out, ThreadPool* pool);
// One weight of a linear_many call, its input (null: the call's x) and its output [tokens, w->rows].
struct LinearTarget {
  const Matrix* w;
  float* out;
  const float* x = nullptr;
};
constexpr size_t kMaxLinearTargets = 32;
// linear of several weights with the same columns. Up to 8 tokens, each input is put in chunk order once per weight
// format and the rows of all the weights run as one parallel job; more tokens run linear per weight.
void linear_many(const float* x, size_t tokens, const LinearTarget* targets, size_t count, ThreadPool* pool);
inline void linear_many(const float* x, size_t tokens, std::initializer_list<LinearTarget> targets,
                        ThreadPool* pool) {
  linear_many(x, tokens, targets.begin(), targets.size(), pool);
}
// Row `row` of W, dequantized: out [cols].
void dequantize_row(const Matrix& w, size_t row, float* out);
// sum_k a[k] b[k] and y += alpha x, on the chosen instruction set (fp32 accumulation).
float dot(const float* a, const float* b, size_t n);
void axpy(float alpha, const float* x, float* y, size_t n);
// out[0..n) = sum_j weights[j] rows[j * stride + 0..n), j ascending (what count axpy calls into zeros would give).
void weighted_sum(const float* weights, const float* rows, size_t count, size_t stride, size_t n, float* out);
// x[i] = SiLU(x[i]) * y[i] (y null: SiLU(x[i])), on the chosen instruction set (AVX2: a polynomial exp).
void silu(float* x, const float* y, size_t n);

// ---- rms_norm.cpp ----
void rms_norm(const float* x, size_t rows, size_t n, const float* w, float eps, float* out);
// RMS-normalise o, multiply by w, then by SiLU(z) (the DeltaNet output norm).
void gated_rms_norm(const float* o, const float* z, size_t rows, size_t n, const float* w, float eps, float* out);
// sum_i x[i]^2 in double, in one fixed order (the norms' sums).
double sum_of_squares(const float* x, size_t n);

// ---- attention.cpp ----
struct AttentionShape {
  size_t heads, kv_heads, head_dim, capacity;  // capacity: rows per KV head of the caches [Hkv, capacity, D]
};
// Causal attention of T queries q [T, Hq, D] at positions first..first+T-1 over the caches, with a sigmoid gate;
// out [T, Hq, D]. Softmax row by row (no T x S score matrix).
void attention(const float* q, const float* keys, const float* values, const float* gate, const AttentionShape& s,
               size_t tokens, size_t first, float scale, float* out, ThreadPool* pool);

// ---- gated_delta.cpp ----
struct DeltaNetShape {
  size_t k_heads, v_heads, k_dim, v_dim, conv_kernel;
  size_t key_dim() const { return k_heads * k_dim; }
  size_t value_dim() const { return v_heads * v_dim; }
  size_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// ---- moe.cpp ----
// Softmax over E logits, top-k (ties to the lower id), renormalised: indices/weights [T, k].
void moe_route(const float* logits, size_t tokens, size_t experts, size_t k, uint32_t* indices, float* weights);

// float exp: within 2 ulp of the reference's double evaluation, and several times faster.
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace lily::cpu
