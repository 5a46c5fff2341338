// CUDA target of the MSL shim: one extern "C" __global__ entry point per kernel instantiation, named by its host
// name (a GNU asm label), that builds each MSL parameter from its attribute, as the CPU harness does per thread.
// The launch ABI (docs/cuda.md) is one by-value parameter, msl_cuda_detail::Params: the [[buffer(i)]] pointers
// (a `constant T&` argument points into a buffer holding the setBytes data) and the byte offset of each
// [[threadgroup(i)]] slice in dynamic shared memory. The host packs the same layout (KernelParams in
// src/lily_ext/cuda/driver_abi.h).

namespace msl_cuda_detail {
constexpr int kMaxBuffers = 31;           // Metal's buffer argument table
constexpr int kMaxThreadgroupSlices = 8;  // [[threadgroup(i)]] parameters
struct Params {
  void* buffers[kMaxBuffers];
  uint32_t threadgroup_offsets[kMaxThreadgroupSlices];
};

extern __shared__ __attribute__((aligned(16))) char dynamic_threadgroup_memory[];

struct Position {
  uint32_t v[3];
};
inline Position tid() { return {{uint32_t(__nvvm_read_ptx_sreg_tid_x()), uint32_t(__nvvm_read_ptx_sreg_tid_y()), uint32_t(__nvvm_read_ptx_sreg_tid_z())}}; }
inline Position ntid() { return {{uint32_t(__nvvm_read_ptx_sreg_ntid_x()), uint32_t(__nvvm_read_ptx_sreg_ntid_y()), uint32_t(__nvvm_read_ptx_sreg_ntid_z())}}; }
inline Position ctaid() { return {{uint32_t(__nvvm_read_ptx_sreg_ctaid_x()), uint32_t(__nvvm_read_ptx_sreg_ctaid_y()), uint32_t(__nvvm_read_ptx_sreg_ctaid_z())}}; }
inline Position nctaid() { return {{uint32_t(__nvvm_read_ptx_sreg_nctaid_x()), uint32_t(__nvvm_read_ptx_sreg_nctaid_y()), uint32_t(__nvvm_read_ptx_sreg_nctaid_z())}}; }
inline uint32_t linear_tid() {
  Position t = tid(), n = ntid();
  return (t.v[2] * n.v[1] + t.v[1]) * n.v[0] + t.v[0];
}

template <class P>
inline P position_arg(Position p) {
  if constexpr (metal::vec_traits<P>::is_vector) {
    P r{};
    for (int i = 0; i < metal::vec_traits<P>::size && i < 3; ++i) r[i] = static_cast<metal::elem_t<P>>(p.v[i]);
    return r;
  } else {
    return static_cast<P>(p.v[0]);
  }
}

template <class P>
inline P make_arg(const ::msl_rt::ParamAttr& a, const Params& p) {
  using ::msl_rt::Attr;
  if constexpr (std::is_pointer_v<P>) {
    if (a.kind == Attr::threadgroup_memory) return (P)(void*)(dynamic_threadgroup_memory + p.threadgroup_offsets[a.index]);
    return (P)p.buffers[a.index];
  } else if constexpr (std::is_reference_v<P>) {
    return *(std::remove_reference_t<P>*)p.buffers[a.index];
  } else {
    switch (a.kind) {
      case Attr::thread_position_in_grid: {
        Position b = ctaid(), n = ntid(), t = tid();
        return position_arg<P>({{b.v[0] * n.v[0] + t.v[0], b.v[1] * n.v[1] + t.v[1], b.v[2] * n.v[2] + t.v[2]}});
      }
      case Attr::thread_position_in_threadgroup: return position_arg<P>(tid());
      case Attr::threadgroup_position_in_grid: return position_arg<P>(ctaid());
      case Attr::threads_per_threadgroup: return position_arg<P>(ntid());
      case Attr::threadgroups_per_grid: return position_arg<P>(nctaid());
      case Attr::threads_per_grid: {
        Position g = nctaid(), n = ntid();
        return position_arg<P>({{g.v[0] * n.v[0], g.v[1] * n.v[1], g.v[2] * n.v[2]}});
      }
      case Attr::thread_index_in_threadgroup: return static_cast<P>(linear_tid());
      case Attr::thread_index_in_simdgroup: return static_cast<P>(linear_tid() % 32);
      case Attr::simdgroup_index_in_threadgroup: return static_cast<P>(linear_tid() / 32);
      case Attr::threads_per_simdgroup:
      case Attr::thread_execution_width: return static_cast<P>(32);
      case Attr::simdgroups_per_threadgroup: {
        Position n = ntid();
        return static_cast<P>((n.v[0] * n.v[1] * n.v[2] + 31) / 32);
      }
      default: __builtin_trap();
    }
  }
}
template <const ::msl_rt::ParamAttr* A, class... P, size_t... I>
[[clang::always_inline]] inline void call(void (*f)(P...), const Params& p, std::index_sequence<I...>) {
  f(make_arg<P>(A[I], p)...);
}
template <class... P>
constexpr int param_count(void (*)(P...)) {
  return int(sizeof...(P));
}

// Each parameter's binding, exported beside the entry point as `<host name>_msl_params` so the host checks its
// arguments before a launch (as the CPU harness does): {attribute, index, how it binds, sizeof what it points to}.
enum ParamBinding : uint32_t { kPointer = 0, kReference = 1, kValue = 2 };
constexpr int kMaxParams = 32;
struct ParamTable {
  uint32_t count;
  uint32_t params[kMaxParams][4];
};
template <class P>
constexpr uint32_t binding_of() {
  return std::is_pointer_v<P> ? kPointer : std::is_reference_v<P> ? kReference : kValue;
}
template <class P>
constexpr uint32_t pointee_size() {
  if constexpr (std::is_pointer_v<P>) {
    using E = std::remove_cv_t<std::remove_pointer_t<P>>;
    if constexpr (std::is_void_v<E>) return 1;
    else return uint32_t(sizeof(E));
  } else if constexpr (std::is_reference_v<P>) {
    return uint32_t(sizeof(std::remove_reference_t<P>));
  } else {
    return uint32_t(sizeof(P));
  }
}
template <const ::msl_rt::ParamAttr* A, class... P>
constexpr ParamTable param_table(void (*)(P...)) {
  static_assert(sizeof...(P) <= kMaxParams, "too many kernel parameters for the CUDA parameter table");
  ParamTable t{};
  t.count = uint32_t(sizeof...(P));
  const uint32_t bindings[] = {binding_of<P>()..., 0u};
  const uint32_t sizes[] = {pointee_size<P>()..., 0u};
  for (uint32_t i = 0; i < t.count; ++i) {
    t.params[i][0] = uint32_t(A[i].kind);
    t.params[i][1] = uint32_t(A[i].index);
    t.params[i][2] = bindings[i];
    t.params[i][3] = sizes[i];
  }
  return t;
}
// The MSL body must be inlined into its entry point: as a real call, a large unrolled body spills.
template <auto F, const ::msl_rt::ParamAttr* A>
[[clang::always_inline]] inline void launch(const Params& p) {
  call<A>(F, p, std::make_index_sequence<param_count(F)>{});
}

// Programmatic dependent launch: wait for the dispatches this one depends on (and let the next one start). Run by
// every entry point before its kernel, and by lily::grid_dependency_wait (metal/lily.h) in the kernels that wait
// themselves.
[[clang::always_inline]] inline void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900  // griddepcontrol: Hopper on (sm_80 PTX has no early start)
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}
}  // namespace msl_cuda_detail

// The entry point is outside the implicit host-device region (a __global__ function cannot be __host__ __device__).
#define MSL_CUDA_ENTRY(host_name, call, fn_ptr, attrs)                                                   \
  _Pragma("clang force_cuda_host_device end")                                                           \
  extern __attribute__((__device__)) const ::msl_cuda_detail::ParamTable MSL_CPU_CAT(msl_params_, __LINE__)  \
      __asm__(host_name "_msl_params") =                                                                 \
      ::msl_cuda_detail::param_table<attrs>(fn_ptr);                                                    \
  extern "C" __global__ void MSL_CPU_CAT(msl_entry_, __LINE__)(::msl_cuda_detail::Params) __asm__(host_name); \
  extern "C" __global__ void MSL_CPU_CAT(msl_entry_, __LINE__)(::msl_cuda_detail::Params p) { call; }   \
  _Pragma("clang force_cuda_host_device begin")
#define MSL_CPU_CAT2(a, b) a##b
#define MSL_CPU_CAT(a, b) MSL_CPU_CAT2(a, b)
// `fn<targs...>` as the __global__ function `host_name`; msl_param_attrs_<fn> comes from the generated code.
// Every entry point but an early one (MSL_CPU_INSTANTIATE_EARLY) waits for its producers before the kernel runs.
#define MSL_CUDA_INSTANTIATE(host_name, wait, fn, ...)                                                   \
  static_assert(::msl_cuda_detail::param_count(&fn<__VA_ARGS__>) ==                                     \
                    int(sizeof(msl_param_attrs_##fn) / sizeof(msl_param_attrs_##fn[0])),                \
                "kernel parameter count and attribute table disagree");                                 \
  MSL_CUDA_ENTRY(host_name, (wait, ::msl_cuda_detail::launch<&fn<__VA_ARGS__>, msl_param_attrs_##fn>(p)),     \
                 (&fn<__VA_ARGS__>), msl_param_attrs_##fn)
#define MSL_CPU_INSTANTIATE(host_name, fn, ...) \
  MSL_CUDA_INSTANTIATE(host_name, ::msl_cuda_detail::grid_dependency_wait(), fn, __VA_ARGS__)
#define MSL_CPU_INSTANTIATE_EARLY(host_name, fn, ...) MSL_CUDA_INSTANTIATE(host_name, (void)0, fn, __VA_ARGS__)
#define MSL_CPU_INSTANTIATE_PLAIN(host_name, fn)                                                         \
  MSL_CUDA_ENTRY(host_name, (::msl_cuda_detail::grid_dependency_wait(),                                  \
                             ::msl_cuda_detail::launch<&fn, msl_param_attrs_##fn>(p)),                  \
                 &fn, msl_param_attrs_##fn)
