// MSL CPU harness: a SMALL EMULATION of Metal 4 tensors and `mpp::tensor_ops::matmul2d`
// (MetalPerformancePrimitives), only what metal/qmatmul.metal's qmm_nax kernels use. Reached through the one-line
// <metal_tensor> and <MetalPerformancePrimitives/MetalPerformancePrimitives.h> of this directory.
//
// Emulated: 2-D `tensor<E, dextents<I, 2>, kind>` views (x = column, contiguous; y = row) with `slice(x, y)`;
// `matmul2d<descriptor, execution_simdgroup>` with `get_destination_cooperative_tensor` and `run(left, right, dest)`;
// `cooperative_tensor` with get_capacity / is_valid_element / operator[] / load / store. The destination fragment
// layout is the one MLX relies on: a 16x16 fragment gives each lane 8 elements at row
// fm + (i / 4) * 8, column fn + i % 4 with qid = lane / 4, fm = (qid & 4) | ((lane / 2) & 3),
// fn = ((qid & 2) | (lane & 1)) * 4; wider destinations are fragments side by side (element 8 f + i).
// run() is a SIMD collective (all 32 lanes, same operands), accumulating in fp32 with one rounding per element;
// reads outside a tensor's extents give 0 and writes there are dropped, as the real op's edge checking.
// Apple's real op may round differently (relaxed_precision) and its layout is implementation-defined: nothing here
// is verified until a Mac with Metal 4 tensor ops (M5) runs the same kernels.
//
// C++17 has no class-type template parameters, so the descriptor converts to an integer key (a constexpr
// user-defined conversion), which is what `matmul2d<desc, scope>` takes here; the kernel source is unchanged.
#pragma once

#include "msl_cpu.h"

namespace metal {

constexpr size_t dynamic_extent = size_t(-1);

template <class I, size_t Rank>
struct dextents {
  static_assert(Rank == 2, "the CPU tensor emulation supports rank-2 extents only");
  I values[Rank];
  constexpr dextents(I x, I y) : values{x, y} {}
  constexpr I extent(int d) const { return values[d]; }
};

struct tensor_handle {};
struct tensor_offset {};
struct tensor_inline {};

// A non-owning view of a row-major matrix: element (x, y) is data[y * extent(0) + x] of the parent, shifted by the
// slice origin; bounds are the parent's extents.
template <class E, class Extents, class Kind = tensor_handle>
struct tensor {
  E* data;
  Extents ext;
  int origin_x = 0;
  int origin_y = 0;

  tensor(E* d, Extents e) : data(d), ext(e) {}
  tensor(E* d, Extents e, int x, int y) : data(d), ext(e), origin_x(x), origin_y(y) {}
  Extents extents() const { return ext; }
  tensor<E, Extents, tensor_offset> slice(int x, int y) const {
    return tensor<E, Extents, tensor_offset>(data, ext, origin_x + x, origin_y + y);
  }
  bool inside(int x, int y) const {
    int gx = origin_x + x, gy = origin_y + y;
    return gx >= 0 && gy >= 0 && gx < int(ext.extent(0)) && gy < int(ext.extent(1));
  }
  float read(int x, int y) const {
    return inside(x, y) ? float(data[size_t(origin_y + y) * size_t(ext.extent(0)) + size_t(origin_x + x)]) : 0.0f;
  }
  template <class V>
  void write(int x, int y, V v) const {
    if (inside(x, y)) data[size_t(origin_y + y) * size_t(ext.extent(0)) + size_t(origin_x + x)] = v;
  }
};

struct execution_thread {};
struct execution_simdgroup {};
template <int N>
struct execution_simdgroups {};

}  // namespace metal

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;

  constexpr matmul2d_descriptor(int m_, int n_, int k_ = -1, bool transpose_left_ = false,
                                bool transpose_right_ = false, bool relaxed_precision_ = false,
                                mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
  // Integer key standing in for a class-type template argument (see the header comment).
  constexpr operator unsigned long long() const {
    return (unsigned long long)(m & 0xFFFF) | (unsigned long long)(n & 0xFFFF) << 16 |
           (unsigned long long)(k & 0xFFFF) << 32 | (unsigned long long)transpose_left << 48 |
           (unsigned long long)transpose_right << 49 | (unsigned long long)relaxed_precision << 50 |
           (unsigned long long)(matmul_mode == mode::multiply_accumulate) << 51;
  }
};

namespace detail {
// Row and column of element i of a lane's share of a 16-row destination (fragments of 16x16 side by side).
inline void fragment_coord(uint32_t lane, int i, int& row, int& col) {
  uint32_t qid = lane / 4;
  int fm = int((qid & 4) | ((lane / 2) & 3));
  int fn = int(((qid & 2) | (lane & 1)) * 4);
  int j = i % 8;
  row = fm + (j / 4) * 8;
  col = (i / 8) * 16 + fn + j % 4;
}
}  // namespace detail

template <class T, int Rows, int Cols>
struct cooperative_tensor {
  static_assert(Rows == 16 && Cols % 16 == 0, "the CPU emulation covers 16-row simdgroup destinations only");
  static constexpr int capacity = Rows * Cols / 32;
  T elements[capacity];

  ushort get_capacity() const { return capacity; }
  bool is_valid_element(int) const { return true; }
  T& operator[](int i) { return elements[i]; }
  const T& operator[](int i) const { return elements[i]; }
  template <class Tensor>
  void load(Tensor t) {
    uint32_t lane = ::msl_rt::current_lane();
    for (int i = 0; i < capacity; ++i) {
      int r, c;
      detail::fragment_coord(lane, i, r, c);
      elements[i] = static_cast<T>(t.read(c, r));
    }
  }
  template <class Tensor>
  void store(Tensor t) const {
    uint32_t lane = ::msl_rt::current_lane();
    for (int i = 0; i < capacity; ++i) {
      int r, c;
      detail::fragment_coord(lane, i, r, c);
      t.write(c, r, elements[i]);
    }
  }
};

template <unsigned long long Descriptor, class Scope>
struct matmul2d {
  static_assert(std::is_same_v<Scope, metal::execution_simdgroup>,
                "the CPU emulation covers execution_simdgroup matmul2d only");
  static constexpr int M = int(Descriptor & 0xFFFF);
  static constexpr int N = int((Descriptor >> 16) & 0xFFFF);
  static constexpr int K = int((Descriptor >> 32) & 0xFFFF);  // 0xFFFF: dynamic (read from the left operand)
  static constexpr bool kTransposeLeft = (Descriptor >> 48) & 1;
  static constexpr bool kTransposeRight = (Descriptor >> 49) & 1;
  static constexpr bool kAccumulate = (Descriptor >> 51) & 1;

  template <class Left, class Right, class Elem>
  cooperative_tensor<Elem, M, N> get_destination_cooperative_tensor() const {
    return cooperative_tensor<Elem, M, N>{};
  }

  template <class Left, class Right, class Dest>
  struct RunIn {
    const Left* left;
    const Right* right;
  };

  // All 32 lanes must call run with the same operands; the last to arrive computes every lane's elements.
  template <class Left, class Right, class Dest>
  static void combine(void* const* in, void* const* out, uint32_t mask) {
    if (mask != 0xFFFFFFFFu) ::msl_rt::kernel_fault("matmul2d::run needs all 32 lanes of the simdgroup");
    auto* first = static_cast<RunIn<Left, Right, Dest>*>(in[0]);
    for (uint32_t l = 1; l < 32; ++l) {
      auto* p = static_cast<RunIn<Left, Right, Dest>*>(in[l]);
      if (p->left->data != first->left->data || p->left->origin_x != first->left->origin_x ||
          p->left->origin_y != first->left->origin_y || p->right->data != first->right->data ||
          p->right->origin_x != first->right->origin_x || p->right->origin_y != first->right->origin_y)
        ::msl_rt::kernel_fault("matmul2d::run operands differ between lanes of the simdgroup");
    }
    const Left& a = *first->left;
    const Right& b = *first->right;
    const int k_len = K != 0xFFFF ? K : int(kTransposeLeft ? a.ext.extent(1) : a.ext.extent(0));
    for (uint32_t l = 0; l < 32; ++l) {
      auto* d = static_cast<Dest*>(out[l]);
      for (int i = 0; i < d->get_capacity(); ++i) {
        int r, c;
        detail::fragment_coord(l, i, r, c);
        float s = kAccumulate ? float((*d)[i]) : 0.0f;
        for (int k = 0; k < k_len; ++k) {
          float av = kTransposeLeft ? a.read(r, k) : a.read(k, r);
          float bv = kTransposeRight ? b.read(k, c) : b.read(c, k);
          s += av * bv;
        }
        (*d)[i] = static_cast<std::remove_reference_t<decltype((*d)[i])>>(s);
      }
    }
  }

  template <class Left, class Right, class Dest>
  void run_at(const char* site, const Left& left, const Right& right, Dest& dest) const {
    RunIn<Left, Right, Dest> in{&left, &right};
    ::msl_rt::simd_collective(&combine<Left, Right, Dest>, &in, &dest, site, "matmul2d::run");
  }
};

}  // namespace tensor_ops
}  // namespace mpp

// run() is a collective: record its source line like the other collectives (msl_cpu.h).
#define run(...) run_at(MSL_CPU_SITE, __VA_ARGS__)
