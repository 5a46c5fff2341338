// The CPU runtime's kernel table (cpu_runtime.cpp): every kernel name the graph builder emits in float32 mode, as a
// C++ function over host memory that computes what metal/<family>.metal computes, on the thread pool. Each op family
// adds its kernels from its own file (qmatmul.cpp, rms_norm.cpp, attention.cpp, gated_delta.cpp, moe.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "../types.h"
#include "cpu_ops.h"

namespace lily::cpu {

// Routed (token, slot) pairs per layer and expert: the expert load `lily bench` reports for dummy weights.
struct ExpertLoad {
  std::vector<std::vector<uint64_t>> counts;  // [layer][expert]
  void add(int layer, const uint32_t* ids, size_t pairs, size_t experts);
};

// One dispatch of a recorded node: its argument struct (the node's args[0]) and where [[buffer(i)]] points.
struct KernelCall {
  const std::vector<unsigned char>& params;
  const std::vector<unsigned char*>& buffers;  // index i >= 1: [[buffer(i)]]; index 0 is the struct's
  size_t dim;                                   // the number a `#` entry matched (head dim, key head dim); else 0
  Dim3 groups;                                  // the node's grid (a row count where the struct has none)
  int layer;                                    // the layer its label names ("layers.<i>."); -1 where none
  ThreadPool& pool;
  ExpertLoad& load;

  template <class A>
  A args() const {
    A a;
    if (params.size() != sizeof a) throw std::logic_error("[cpu] argument struct of the wrong size");
    std::memcpy(&a, params.data(), sizeof a);
    return a;
  }
  template <class T>
  T* at(size_t i) const {
    return reinterpret_cast<T*>(buffers.at(i));
  }
  // Buffers i, i + 1, i + 2 as one quantized matrix (codes, scales, biases): bits, group 64, `scales` dtype.
  Matrix matrix(size_t i, int bits, DType scales, size_t experts, size_t rows, size_t cols) const;
};

using Kernel = std::function<void(const KernelCall&)>;

// Kernels by host name. A name ending in `#` stands for that name with any number in its place (the head dim of the
// attention kernels, the key head dim of the DeltaNet ones): the CPU functions take any size.
class KernelTable {
 public:
  KernelTable();
  // `sizes`: for a `#` name, the sizes its Metal kernels are instantiated at (what names() lists and tests cover).
  void add(const std::string& name, Kernel kernel, std::vector<size_t> sizes = {});
  // The kernel of `name` and the number that matched a `#` (0 where none); null when the table has none.
  const Kernel* find(const std::string& name, size_t* dim) const;
  // Every name, `#` names at their instantiated sizes, sorted.
  std::vector<std::string> names() const;

 private:
  std::map<std::string, Kernel> kernels_;
  std::map<std::string, std::vector<size_t>> sizes_;
};

// Each family's kernels (its own file).
void add_qmatmul_kernels(KernelTable& table);
void add_rms_norm_kernels(KernelTable& table);
void add_attention_kernels(KernelTable& table);
void add_gated_delta_kernels(KernelTable& table);
void add_moe_kernels(KernelTable& table);

// A float32 value read from memory that may not be aligned (weights are read where the checkpoint maps them).
inline float load_f32(const void* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

}  // namespace lily::cpu
