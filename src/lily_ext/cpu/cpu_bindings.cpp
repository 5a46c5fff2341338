// nanobind bindings of the CPU backend (lily._ext.cpu): conversion only; python/lily/cpu.py is the caller.
#include "cpu_bindings.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../model.h"
#include "cpu_model.h"

namespace nb = nanobind;

namespace lily::cpu {

namespace {

using Floats = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

Span span(const std::tuple<size_t, size_t, size_t>& t) { return {std::get<0>(t), std::get<1>(t), std::get<2>(t)}; }

}  // namespace

void bind(nb::module_& m) {
  m.def("set_isa", &set_isa, nb::arg("name"),
        "Instruction set of the hot loops: 'avx2' (AVX2 + FMA; ValueError where the CPU lacks them) or 'portable'.");
  m.def("isa", &isa, "The instruction set in use: 'avx2' or 'portable'.");
  nb::class_<CpuModel>(m, "CpuModel")
      .def("__init__", [](CpuModel* model, const ModelConfig& config, std::vector<float> inv_freq, size_t threads) {
             new (model) CpuModel(cpu_config(config, std::move(inv_freq)), threads);
           }, nb::arg("config"), nb::arg("inv_freq"), nb::arg("threads"),
           "config: a lily._ext.ModelConfig (lily.backends.engine_config); inv_freq: lily.reference.rope_inv_freq's.")
      .def("add_file", &CpuModel::add_file, nb::arg("path"))
      .def("add_owned",
           [](CpuModel& model, nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> bytes) {
             return model.add_owned(bytes.data(), bytes.shape(0));
           }, nb::arg("bytes"))
      .def_prop_ro("owned_bytes", &CpuModel::owned_bytes)
      .def_prop_ro("threads", &CpuModel::threads)
      .def("bind_matrix",
           [](CpuModel& model, const std::string& name, int bits, int group, const std::string& dtype, size_t experts,
              size_t rows, size_t cols, const std::tuple<size_t, size_t, size_t>& data,
              const std::tuple<size_t, size_t, size_t>& scales, const std::tuple<size_t, size_t, size_t>& biases) {
             model.bind_matrix(name, bits, group, dtype_from_name(dtype), experts, rows, cols, span(data), span(scales),
                               span(biases));
           },
           nb::arg("name"), nb::arg("bits"), nb::arg("group"), nb::arg("dtype"), nb::arg("experts"), nb::arg("rows"),
           nb::arg("cols"), nb::arg("data"), nb::arg("scales"), nb::arg("biases"))
      .def("bind_vector",
           [](CpuModel& model, const std::string& name,
              nb::ndarray<const float, nb::c_contig, nb::device::cpu> values) {
             model.bind_vector(name, std::vector<float>(values.data(), values.data() + values.size()));
           }, nb::arg("name"), nb::arg("values"))
      .def("finish_loading", &CpuModel::finish_loading)
      .def("expert_tokens",
           [](const CpuModel& model) {
             const size_t experts = model.config().num_experts, layers = model.expert_tokens().size() / experts;
             auto* counts = new std::vector<uint64_t>(model.expert_tokens());
             nb::capsule owner(counts, [](void* p) noexcept { delete static_cast<std::vector<uint64_t>*>(p); });
             return nb::ndarray<nb::numpy, uint64_t, nb::ndim<2>>(counts->data(), {layers, experts}, owner);
           },
           "Routed (token, slot) pairs per layer and expert since loading or the last reset, uint64 [layers, experts].")
      .def("reset_expert_tokens", &CpuModel::reset_expert_tokens)
      .def("forward",
           [](CpuModel& model, nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids,
              size_t position, const std::vector<std::tuple<Floats, Floats>>& states,
              nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> logits, bool last_only) {
             const size_t tokens = ids.shape(0);
             if (tokens == 0) throw nb::value_error("forward needs at least one token");
             if (logits.shape(0) != (last_only ? 1 : tokens) || logits.shape(1) != model.config().vocab_size)
               throw nb::value_error("logits must be float32 [tokens (1 if last_only), vocab_size]");
             std::vector<LayerState> layers;
             for (const auto& [first, second] : states)
               layers.push_back({first.data(), second.data(), first.size(), second.size()});
             nb::gil_scoped_release release;
             model.forward(ids.data(), tokens, position, layers, logits.data(), last_only);
           },
           nb::arg("ids"), nb::arg("position"), nb::arg("states"), nb::arg("logits"), nb::arg("last_only"),
           "Run ids after `position` tokens; states[i] is layer i's (keys, values) or (conv, recurrent) float32\n"
           "arrays, updated in place (keys/values need position + len(ids) rows).");
}

}  // namespace lily::cpu
