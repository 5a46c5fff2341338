// nanobind entry point of lily._ext; binds engine functions and holds no logic.
#include <nanobind/nanobind.h>

#include "cpu/cpu_bindings.h"
#include "cuda/cuda_bindings.h"

#if defined(LILY_TEST_BUILD)
#include "../test_doubles/engine_test/engine_test_bindings.h"
#endif

// ---- model graph and plan: includes ----
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cpu/cpu_runtime.h"
#include "cuda/runtime.h"
#include "metal_runtime.h"
#include "plan.h"
#include "tuning.h"
// ---- end ----

#if defined(LILY_METAL_TEST_RUNTIME)
#include "msl_py.h"
#endif

namespace nb = nanobind;

// ---- what crosses into the engines typed (config, switches, token choice; docs/architecture.md), model graph and
// plan (docs/engine.md, "The model graph"): conversion only ----
namespace {

// lily::ModelConfig under the field names of lily.config.ModelArgs, which lily.backends.engine_config fills.
void bind_model_config(nb::module_ m) {
  using C = lily::ModelConfig;
  nb::class_<C>(m, "ModelConfig",
                "The text configuration the compiled engines read (metal, cuda and cpu), named as in "
                "lily.config.ModelArgs; build it with lily.backends.engine_config(args).")
      .def(nb::init<>())
      .def_rw("vocab_size", &C::vocab_size)
      .def_rw("hidden_size", &C::hidden_size)
      .def_prop_rw(
          "layer_types",
          [](const C& c) {
            std::vector<std::string> out;
            for (bool attention : c.attention_layers) out.push_back(attention ? "full_attention" : "linear_attention");
            return out;
          },
          [](C& c, const std::vector<std::string>& types) {
            std::vector<bool> layers;
            for (const std::string& t : types) {
              if (t != "full_attention" && t != "linear_attention") {
                throw nb::value_error(("layer_types: unknown layer type '" + t +
                                       "'; expected 'full_attention' or 'linear_attention'").c_str());
              }
              layers.push_back(t == "full_attention");
            }
            c.attention_layers = std::move(layers);
          },
          "Per layer: 'full_attention' (gated attention) or 'linear_attention' (Gated DeltaNet).")
      .def_rw("num_attention_heads", &C::num_heads)
      .def_rw("num_key_value_heads", &C::num_kv_heads)
      .def_rw("head_dim", &C::head_dim)
      .def_rw("rotary_dim", &C::rotary_dim)
      .def_rw("linear_num_key_heads", &C::gdn_k_heads)
      .def_rw("linear_num_value_heads", &C::gdn_v_heads)
      .def_rw("linear_key_head_dim", &C::gdn_k_dim)
      .def_rw("linear_value_head_dim", &C::gdn_v_dim)
      .def_rw("linear_conv_kernel_dim", &C::conv_kernel)
      .def_rw("num_experts", &C::num_experts)
      .def_rw("num_experts_per_tok", &C::top_k)
      .def_rw("moe_intermediate_size", &C::expert_size)
      .def_rw("shared_expert_intermediate_size", &C::shared_expert_size)
      .def_rw("rms_norm_eps", &C::eps)
      .def_rw("rope_theta", &C::rope_theta);
}

// lily::Switches: the engine switches (lily.backends.engine.SWITCHES) and the sizes tests lower (TEST_OPTIONS),
// which lily.backends.engine.engine_switches sets.
void bind_switches(nb::module_ m) {
  using S = lily::Switches;
  nb::class_<S>(m, "Switches", "Engine options, every one on by default; build it with "
                               "lily.backends.engine.engine_switches(mapping).")
      .def(nb::init<>())
      .def_rw("concurrent", &S::concurrent)
      .def_rw("fused_projections", &S::fused_projections)
      .def_rw("fusion", &S::fusion)
      .def_rw("split_kv", &S::split_kv)
      .def_rw("split_prefill_kv", &S::split_prefill_kv)
      .def_rw("gpu_token", &S::gpu_token)
      .def_rw("batched_prefill", &S::batched_prefill)
      .def_rw("wide_tiles", &S::wide_tiles)
      .def_rw("gpu_routing", &S::gpu_routing)
      .def_rw("chunked_prefill", &S::chunked_prefill)
      .def_rw("gqa_packing", &S::gqa_packing)
      .def_rw("replayed_prompts", &S::replayed_prompts)
      .def_rw("register_scan", &S::register_scan)
      .def_rw("chunked_scan", &S::chunked_scan)
      .def_rw("in_gemm_dequant", &S::in_gemm_dequant)
      .def_rw("coalesced_kv", &S::coalesced_kv)
      .def_rw("tensor_ops", &S::tensor_ops)
      .def_rw("mma_attention", &S::mma_attention)
      .def_rw("staged_gemv", &S::staged_gemv)
      .def_rw("spread_deltanet_step", &S::spread_deltanet_step)
      .def_rw("whole_pack_loads", &S::whole_pack_loads)
      .def_rw("fused_attention_prep", &S::fused_attention_prep)
      .def_rw("fused_argmax", &S::fused_argmax)
      .def_rw("early_moe_down", &S::early_moe_down)
      .def_rw("mma_gemv", &S::mma_gemv)
      .def_rw("split_steps", &S::split_steps)
      .def_rw("split_kv_min_keys", &S::split_kv_min_keys)
      .def_rw("split_kv_block_keys", &S::split_kv_block_keys)
      .def_rw("split_prefill_block_keys", &S::split_prefill_block_keys)
      .def_rw("prefill_chunk", &S::prefill_chunk)
      .def_rw("seg_stream_groups", &S::seg_stream_groups)
      .def_rw("kv_block", &S::kv_block);
}

// lily::TokenChoice: how the GPU chooses a token, built from lily.sampling.SamplingParams by
// lily.backends.engine.token_choice (the logit bias flag follows the bias ids begin_decode receives).
void bind_token_choice(nb::module_ m) {
  using T = lily::TokenChoice;
  nb::class_<T>(m, "TokenChoice", "The GPU's token choice (lily.sampling steps 1-6).")
      .def(
          "__init__",
          [](T* t, float temperature, uint32_t top_k, float top_p, float min_p, uint64_t seed,
             float repetition_penalty, float presence_penalty, float frequency_penalty) {
            new (t) T{temperature, top_k, top_p, min_p, seed, repetition_penalty, presence_penalty, frequency_penalty,
                      /*logit_bias=*/false};
          },
          nb::kw_only(), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"), nb::arg("min_p"),
          nb::arg("seed"), nb::arg("repetition_penalty"), nb::arg("presence_penalty"),
          nb::arg("frequency_penalty"))
      .def_ro("temperature", &T::temperature)
      .def_ro("top_k", &T::top_k)
      .def_ro("top_p", &T::top_p)
      .def_ro("min_p", &T::min_p)
      .def_ro("seed", &T::seed)
      .def_ro("repetition_penalty", &T::repetition_penalty)
      .def_ro("presence_penalty", &T::presence_penalty)
      .def_ro("frequency_penalty", &T::frequency_penalty);
}

lily::Precision precision_from(const std::string& name) {
  if (name == "float32") return lily::Precision::Float32;
  if (name == "bfloat16") return lily::Precision::BFloat16;
  throw nb::value_error(("precision must be 'float32' or 'bfloat16'; got '" + name + "'").c_str());
}

nb::list spans_list(const std::vector<lily::Span>& spans) {
  nb::list out;
  for (const lily::Span& s : spans) out.append(nb::make_tuple(s.buffer, s.offset, s.length));
  return out;
}

// buffers [(name, bytes)] and nodes [{kernel, label, groups, threads, reads, writes, barrier_before, depends_on,
// early_reads, early_start}] of a graph, into `out`.
void add_graph(const lily::Graph& graph, nb::dict& out) {
  nb::list buffers, nodes;
  for (const lily::GraphBuffer& b : graph.buffers) buffers.append(nb::make_tuple(b.name, b.length));
  const std::vector<std::vector<size_t>> edges = lily::dependencies(graph, 0, graph.nodes.size());
  const std::vector<bool> early = lily::early_starts(graph, 0, graph.nodes.size(), edges);
  for (const lily::Node& n : graph.nodes) {
    nb::dict node;
    node["early_start"] = bool(early[nodes.size()]);  // its CUDA graph edge is programmatic (with PDL on)
    node["early_reads"] = spans_list(n.early_reads);
    node["depends_on"] = edges[nodes.size()];  // the CUDA graph's edges into this node
    node["kernel"] = n.kernel;
    node["label"] = n.label;
    node["groups"] = nb::make_tuple(n.groups.width, n.groups.height, n.groups.depth);
    node["threads"] = nb::make_tuple(n.threads.width, n.threads.height, n.threads.depth);
    node["reads"] = spans_list(n.reads);
    node["writes"] = spans_list(n.writes);
    node["barrier_before"] = n.barrier_before;
    nodes.append(node);
  }
  out["buffers"] = buffers;
  out["nodes"] = nodes;
}

nb::dict memory_dict(const lily::DeviceMemory& m) {
  nb::dict out;
  out["weights"] = m.weights, out["kv_cache"] = m.kv_cache, out["state"] = m.state, out["scratch"] = m.scratch;
  out["total"] = m.total(), out["peak"] = m.peak;
  return out;
}

nb::dict plan_decode(const lily::ModelConfig& config, size_t context, const std::string& precision,
                     const lily::Switches& switches, bool with_graph) {
  lily::DecodePlan plan = lily::plan_decode(config, precision_from(precision), switches, context);
  nb::dict out, minimum, by_kernel;
  out["dispatches"] = plan.counts.dispatches;
  out["stages"] = plan.counts.stages;
  out["barriers"] = plan.counts.barriers;
  out["bytes_read"] = plan.counts.bytes_read;
  out["bytes_written"] = plan.counts.bytes_written;
  out["context"] = plan.context;
  out["kv_capacity"] = plan.kv_capacity;
  minimum["weights"] = plan.minimum.weights;
  minimum["recurrent_state"] = plan.minimum.recurrent_state;
  minimum["conv_state"] = plan.minimum.conv_state;
  minimum["kv_cache"] = plan.minimum.kv_cache;
  minimum["total"] = plan.minimum.total();
  out["minimum_bytes"] = minimum;
  out["memory"] = memory_dict(plan.memory);
  out["kv_bytes_per_token"] = plan.kv_bytes_per_token;
  for (const auto& [kernel, n] : plan.counts.dispatches_by_kernel) by_kernel[kernel.c_str()] = n;
  out["dispatches_by_kernel"] = by_kernel;
  out["fast_paths_left_out"] = plan.fast_paths_left_out;
  if (with_graph) add_graph(plan.graph, out);
  return out;
}

lily::DType dtype_from(const std::string& name) {
  if (name == "float32") return lily::DType::F32;
  if (name == "bfloat16") return lily::DType::BF16;
  if (name == "float16") return lily::DType::F16;
  if (name == "uint32") return lily::DType::U32;
  throw nb::value_error(("unsupported tensor dtype '" + name + "'").c_str());
}

lily::Span span_from(const std::tuple<int, size_t, size_t>& t) {
  return lily::Span{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
}

void bind_weight(lily::Engine& e, const std::string& name, int bits, const std::string& dtype,
                 const std::string& scale_dtype, size_t experts, size_t rows, size_t cols,
                 const std::tuple<int, size_t, size_t>& data, const std::tuple<int, size_t, size_t>& scales,
                 const std::tuple<int, size_t, size_t>& biases) {
  lily::WeightRef ref;
  ref.bits = bits;
  ref.dtype = dtype_from(dtype);
  ref.scale_dtype = dtype_from(scale_dtype);
  ref.experts = experts;
  ref.rows = rows;
  ref.cols = cols;
  ref.data = span_from(data);
  ref.scales = span_from(scales);
  ref.biases = span_from(biases);
  e.bind_weight(name, ref);
}

// Engine::node_times() as [(kernel, label, milliseconds)].
nb::list node_times_list(const lily::Engine& e) {
  nb::list rows;
  for (const lily::Engine::NodeTime& t : e.node_times()) rows.append(nb::make_tuple(t.kernel, t.label, t.milliseconds));
  return rows;
}

nb::dict counts_dict(const lily::Graph& graph) {
  lily::GraphCounts c = lily::count_graph(graph);
  nb::dict d;
  d["dispatches"] = c.dispatches;
  d["stages"] = c.stages;
  d["barriers"] = c.barriers;
  d["bytes_read"] = c.bytes_read;
  d["bytes_written"] = c.bytes_written;
  nb::dict by_kernel;
  for (const auto& [kernel, n] : c.dispatches_by_kernel) by_kernel[kernel.c_str()] = n;
  d["dispatches_by_kernel"] = by_kernel;
  return d;
}

}  // namespace
// ---- end of model graph and plan ----

// ---- kernel runner (lily._ext.kernels, for `python -m lily.selftest --device metal-api`): conversion only ----
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <optional>

#include "kernel_runner.h"
#include "py_args.h"

namespace {

// {index: bool} -> Bool constants; {index: int} -> Int constants (as _test_engine takes them).
std::vector<lily::FunctionConstant> runner_constants(const std::optional<nb::dict>& constants) {
  std::vector<lily::FunctionConstant> out;
  if (!constants) return out;
  for (auto [key, value] : *constants) {
    int index = 0;
    if (!nb::isinstance<nb::int_>(key) || nb::isinstance<nb::bool_>(key) || !nb::try_cast<int>(key, index)) {
      throw nb::type_error(("constants: keys are function-constant indices (int); got " +
                            std::string(nb::repr(key).c_str())).c_str());
    }
    if (nb::isinstance<nb::bool_>(value)) {
      out.push_back({index, lily::mtl::DataType::Bool, nb::cast<bool>(value) ? 1 : 0});
    } else if (int64_t number = 0; nb::isinstance<nb::int_>(value) && nb::try_cast<int64_t>(value, number)) {
      out.push_back({index, lily::mtl::DataType::Int, number});  // the device checks the int32 range
    } else {
      throw nb::type_error(("constants[" + std::to_string(index) + "] must be a bool or a 64-bit int; got " +
                            nb::type_name(value.type()).c_str()).c_str());
    }
  }
  return out;
}

void bind_kernel_runner(nb::module_ m) {
  m.doc() = "Runs one kernel at a time through the Metal API (the real GPU on macOS, the fake Metal on Linux).";
  // The build's one kernel-library mode: True when lily.metallib was built ahead of time (LILY_AOT_METALLIB).
#if defined(LILY_AOT_METALLIB)
  m.attr("aot_metallib") = true;
#else
  m.attr("aot_metallib") = false;
#endif
  m.def(
      "family_sources",
      [] {
        std::map<std::string, std::string> out;
        for (const lily::KernelFamily& f : lily::embedded_kernel_families()) out[f.name] = f.source;
        return out;
      },
      "The embedded kernel libraries: family name -> MSL source (metal/lily.h and metal/<family>.metal).");
  nb::class_<lily::KernelRunner>(m, "Runner")
      .def(
          "__init__",
          [](lily::KernelRunner* runner, const std::optional<std::string>& kernel_source,
             const std::optional<std::string>& metallib, const std::map<std::string, std::string>& family_sources,
             const std::optional<std::vector<std::string>>& kernel_names) {
            if (kernel_source && !kernel_names) {
              throw nb::value_error("Runner: kernel_source needs kernel_names, the host names it instantiates "
                                    "(tools/msl_text.py host_names reads them)");
            }
            if (metallib) {
              new (runner) lily::KernelRunner(lily::MetallibFile{*metallib},
                                              kernel_names ? *kernel_names : lily::embedded_kernel_names());
            } else if (kernel_source) {
              new (runner) lily::KernelRunner(*kernel_source, *kernel_names);
            } else {
              new (runner) lily::KernelRunner(lily::embedded_kernel_families(family_sources));
            }
          },
          nb::arg("kernel_source") = nb::none(), nb::arg("metallib") = nb::none(),
          nb::arg("family_sources") = std::map<std::string, std::string>(), nb::arg("kernel_names") = nb::none(),
          "Opens the default Metal device and compiles kernel_source as one library, or by default Lily's embedded\n"
          "kernels as one library per family (family_sources replaces the source of the families it names), or,\n"
          "given metallib (a path), loads that precompiled library. kernel_names: the host names kernel_source or\n"
          "the metallib instantiates (by default those of Lily's kernels).")
      .def_prop_ro("device_name", &lily::KernelRunner::device_name)
      .def(
          "library_failures",
          [](const lily::KernelRunner& runner) {
            nb::list out;
            for (const lily::LibraryFailure& f : runner.library_failures()) {
              nb::dict row;
              row["family"] = f.family;
              row["file"] = f.file;
              row["diagnostic"] = f.diagnostic;
              row["kernels"] = f.kernels;
              out.append(row);
            }
            return out;
          },
          "Kernel families that did not compile: dicts of family, file, Metal's diagnostic and their kernels.")
      .def("kernel_names", &lily::KernelRunner::kernel_names, nb::call_guard<nb::gil_scoped_release>(),
           "Kernels instantiated in the source that the compiled library has, sorted.")
      .def("missing_kernel_names", &lily::KernelRunner::missing_kernel_names,
           nb::call_guard<nb::gil_scoped_release>(),
           "Kernels instantiated in the source that the compiled library lacks (an #if false on this GPU).")
      .def(
          "run",
          [](lily::KernelRunner& runner, const std::string& name, const nb::list& args,
             std::array<size_t, 3> threadgroups, std::array<size_t, 3> threads,
             const std::optional<nb::dict>& constants) {
            lily::py_args::BufferArguments<lily::KernelArgument> bound(
                name, args, "copied back into it", lily::py_args::NotBufferError::TypeError);
            std::vector<lily::FunctionConstant> values = runner_constants(constants);
            nb::gil_scoped_release release;
            runner.run(name, bound.bindings(), {threadgroups[0], threadgroups[1], threadgroups[2]},
                       {threads[0], threads[1], threads[2]}, std::move(values));
          },
          nb::arg("name"), nb::arg("args"), nb::arg("threadgroups"), nb::arg("threads_per_threadgroup"),
          nb::arg("constants") = nb::none(),
          "Run kernel `name` once in one command buffer and wait. args[i] binds [[buffer(i)]]: a C-contiguous\n"
          "writable numpy array is copied into a Metal buffer and back after the run; bytes are setBytes data.\n"
          "constants maps function-constant index to bool/int. Raises RuntimeError naming the kernel.");
}

}  // namespace
// ---- end of kernel runner ----

namespace {
void bind_engine(nb::module_ m);    // lily::Engine, the metal backend's engine
void bind_platform(nb::module_ m);  // which Metal the extension talks to, and the CPU harness where it is built
}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "Lily's compiled engine (private; use the lily package).";
#if defined(LILY_TEST_BUILD)
  // Test builds only (LILY_TEST_BUILD): the host engine's device and encoder and (on Linux) the fake Metal.
  lily::bind_test_engine(m.def_submodule("_test_engine"));
#endif
  // Kernel runner: one kernel at a time through the Metal API (lily.selftest --device metal-api).
  bind_kernel_runner(m.def_submodule("kernels"));
  // What crosses into the engines typed: the model's configuration, the engine switches, the GPU token choice.
  bind_model_config(m);
  bind_switches(m);
  bind_token_choice(m);
  // The CPU backend (backend="cpu").
  nb::module_ cpu = m.def_submodule("cpu");
  lily::cpu::bind(cpu);
  nb::module_ cuda = m.def_submodule("cuda");  // the CUDA driver layer (docs/cuda.md)
  lily::cuda::bind(cuda);
  // Model graph and plan.
  m.def("plan_decode", &plan_decode, nb::arg("config"), nb::arg("context"), nb::arg("precision") = "bfloat16",
        nb::arg("switches") = lily::Switches(), nb::arg("with_graph") = false,
        "Build (not run) the decode graph of a config; counts and minimum bytes per token.");
  // Tokens per prefill chunk (tuning::kPrefillChunk): the engine backends' PrefillChunking capability.
  m.attr("prefill_chunk") = lily::tuning::kPrefillChunk;
  m.def("fast_paths_left_out", &lily::fast_paths_left_out, nb::arg("config"),
        "The fast paths the config's shape does not fit, one line each (the engine runs general kernels).");
  m.def(
      "graph_kernels",
      [](const lily::ModelConfig& config, const std::string& precision, const lily::Switches& switches, int bits,
         bool f32_scales, const std::vector<size_t>& prefill_rows) {
        return lily::graph_kernels(config, precision_from(precision), switches, bits,
                                   f32_scales ? lily::DType::F32 : lily::DType::BF16, prefill_rows);
      },
      nb::arg("config"), nb::arg("precision"), nb::arg("switches"), nb::arg("bits"), nb::arg("f32_scales"),
      nb::arg("prefill_rows"), "The kernels the engine's decode and prefill graphs dispatch for this configuration.");
  bind_engine(m);
  bind_platform(m);
}

namespace {
void new_engine(lily::Engine* e, const lily::ModelConfig& config, const std::string& precision,
                const lily::Switches& switches,
                size_t max_context, const std::optional<std::string>& metallib,
                const std::map<std::string, std::string>& family_sources, const std::string& runtime_name,
                const std::string& ptx_dir, size_t threads) {
  std::unique_ptr<lily::Runtime> runtime;
  if (runtime_name == "cpu") {
    runtime = std::make_unique<lily::CpuRuntime>(threads);
  } else if (runtime_name == "cuda") {
    runtime = std::make_unique<lily::CudaRuntime>(0, ptx_dir);
  } else if (runtime_name == "metal") {
    std::optional<lily::MetallibFile> library;
    if (metallib) library = lily::MetallibFile{*metallib};
    runtime = std::make_unique<lily::MetalRuntime>(lily::embedded_kernel_families(family_sources), library);
  } else {
    throw nb::value_error(("runtime must be 'metal', 'cuda' or 'cpu'; got '" + runtime_name + "'").c_str());
  }
  new (e) lily::Engine(config, precision_from(precision), switches, max_context, std::move(runtime));
}

void begin_decode(lily::Engine& e, nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> logits,
                  lily::TokenChoice choice, std::vector<uint32_t> bias_ids, std::vector<float> bias_values,
                  std::vector<uint32_t> context) {
  if (logits.shape(0) != e.config().vocab_size) throw nb::value_error("logits must be float32 [vocab_size]");
  choice.logit_bias = !bias_ids.empty();
  e.begin_decode(logits.data(), choice,
                 lily::PenaltyInputs{std::move(bias_ids), std::move(bias_values), std::move(context)});
}

void bind_engine(nb::module_ m) {
  nb::class_<lily::Engine>(m, "Engine")
      .def("__init__", &new_engine,
           nb::arg("config"), nb::arg("precision"), nb::arg("switches"), nb::arg("max_context"),
           nb::arg("metallib") = nb::none(), nb::arg("family_sources") = std::map<std::string, std::string>(),
           nb::arg("runtime") = "metal", nb::arg("ptx_dir") = "", nb::arg("threads") = 1)
      .def("add_file", &lily::Engine::add_file, nb::arg("path"))
      .def("buffer_origin", &lily::Engine::buffer_origin, nb::arg("id"))
      .def("add_owned",
           [](lily::Engine& e, nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> bytes) {
             return e.add_owned(bytes.data(), bytes.shape(0));
           },
           nb::arg("bytes"))
      .def_prop_ro("owned_bytes", &lily::Engine::owned_bytes)
      .def("bind_weight", &bind_weight, nb::arg("name"), nb::arg("bits"), nb::arg("dtype"), nb::arg("scale_dtype"),
           nb::arg("experts"), nb::arg("rows"), nb::arg("cols"), nb::arg("data"), nb::arg("scales"),
           nb::arg("biases"))
      .def("finish_loading", &lily::Engine::finish_loading)
      .def("reset", &lily::Engine::reset)
      .def_prop_ro("position", &lily::Engine::position)
      .def("snapshot",
           [](const lily::Engine& e) {
             std::vector<unsigned char> s = e.snapshot();
             return nb::bytes(reinterpret_cast<const char*>(s.data()), s.size());
           })
      .def("restore",
           [](lily::Engine& e, nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data,
              size_t position) { e.restore(data.data(), data.shape(0), position); },
           nb::arg("snapshot"), nb::arg("position"))
      .def("snapshot_bytes", &lily::Engine::snapshot_bytes, nb::arg("position"))
      .def("forward",
           [](lily::Engine& e, const std::vector<uint32_t>& tokens,
              nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out, long dropped_barrier,
              bool last_only) {
             if (out.shape(0) != (last_only ? 1 : tokens.size()) || out.shape(1) != e.config().vocab_size) {
               throw nb::value_error(last_only ? "out must be float32 [1, vocab_size]"
                                               : "out must be float32 [len(tokens), vocab_size]");
             }
             nb::gil_scoped_release released;
             e.forward(tokens, out.data(), dropped_barrier, last_only);
           },
           nb::arg("tokens"), nb::arg("out"), nb::arg("dropped_barrier") = -1, nb::arg("last_only") = false)
      .def("begin_decode", &begin_decode,
           nb::arg("logits"), nb::arg("choice"), nb::arg("bias_ids") = std::vector<uint32_t>{},
           nb::arg("bias_values") = std::vector<float>{}, nb::arg("context") = std::vector<uint32_t>{},
           "Commits the first token's choice (a TokenChoice: lily.backends.engine.token_choice) over `logits` "
           "(lily.sampling steps 1-6: a logit bias given as ids and values, penalties over `context` and the tokens "
           "chosen)")
      .def("submit_step", &lily::Engine::submit_step)
      .def("next_token", &lily::Engine::next_token, nb::call_guard<nb::gil_scoped_release>())
      .def("end_decode", &lily::Engine::end_decode, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("steps_in_flight", &lily::Engine::steps_in_flight)
      .def("read_logits",
           [](lily::Engine& e, nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu> out) {
             if (out.shape(0) != e.config().vocab_size) throw nb::value_error("out must be float32 [vocab_size]");
             e.read_logits(out.data());
           },
           nb::arg("out"))
      .def_prop_ro("host_read_bytes", &lily::Engine::host_read_bytes)
      .def("set_host_timing", &lily::Engine::set_host_timing, nb::arg("encode"), nb::arg("cpp"))
      .def_prop_ro("step_encode_ns", &lily::Engine::step_encode_ns)
      .def_prop_ro("step_cpp_ns", &lily::Engine::step_cpp_ns)
      .def("reset_host_timing", &lily::Engine::reset_host_timing)
      .def_prop_ro("programs_built", &lily::Engine::programs_built)
      .def("split_blocks", &lily::Engine::split_blocks, nb::arg("position"),
           "Split-KV blocks of the decode step at `position` (0: single pass; tuning::attention_split_blocks).")
      .def("device_memory", [](const lily::Engine& e) { return memory_dict(e.device_memory()); })
      .def("bind_synthetic_weights", &lily::Engine::bind_synthetic_weights)
      .def("generate_greedy", &lily::Engine::generate_greedy, nb::arg("first"), nb::arg("count"))
      .def("last_step_counts", [](const lily::Engine& e) { return counts_dict(e.last_graph()); })
      .def("set_profiling", &lily::Engine::set_profiling, nb::arg("on"))
      .def("supports_profiling", &lily::Engine::supports_profiling)
      .def("node_times", &node_times_list)
      .def("clear_node_times", &lily::Engine::clear_node_times)
      .def("last_step_graph", [](const lily::Engine& e) {
        nb::dict out;
        add_graph(e.last_graph(), out);
        return out;
      });
}

void bind_platform(nb::module_ m) {
#if defined(__APPLE__)
  m.attr("platform") = "metal";
#elif defined(LILY_METAL_TEST_RUNTIME)
  m.attr("platform") = "cpu-emulation";
  nb::module_ msl = m.def_submodule("msl");
  msl_py::bind(msl);
#else
  m.attr("platform") = "none";  // built without the Metal test runtime (CMakeLists.txt)
#endif
}
}  // namespace
