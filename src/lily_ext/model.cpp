// The graph's types, the model configuration check and the CPU's MoE sort (see model.h).
#include "model.h"

#include <algorithm>

#include "../../metal/lily.h"
#include "ops/ops.h"
#include "tuning.h"

namespace lily {

namespace {

[[noreturn]] void bad_config(const std::string& field, const std::string& why) {
  throw Error("[engine] config field " + field + ": " + why);
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

void DeviceMemory::add(const StateBuffers& held, int id, BufferRole role, uint64_t bytes) {
  const auto holds = [id](const std::vector<int>& ids) { return std::find(ids.begin(), ids.end(), id) != ids.end(); };
  const bool kv = holds(held.k_cache) || holds(held.v_cache);
  (kv                            ? kv_cache
   : role == BufferRole::Weights ? weights
   : role == BufferRole::State   ? state
                                 : scratch) += bytes;
}

void host_moe_sort(const HostMoeSort& s, const uint32_t* ids, uint32_t* expert_offsets, uint32_t* tile_map,
                   uint32_t* tile_count, uint32_t* sorted_pairs) {
  std::vector<uint32_t> counts(s.experts, 0);
  for (size_t p = 0; p < s.pairs; ++p) {
    if (ids[p] >= s.experts) {
      throw Error("[engine] MoE routing wrote expert id " + std::to_string(ids[p]) + " for pair " +
                       std::to_string(p) + "; the layer has " + std::to_string(s.experts) + " experts");
    }
    ++counts[ids[p]];
  }
  uint32_t rows = 0, tiles = 0;
  for (size_t e = 0; e < s.experts; ++e) {
    expert_offsets[e] = rows;
    for (uint32_t first = 0; first < counts[e]; first += static_cast<uint32_t>(s.tile_rows)) {
      if (tiles >= s.max_tiles) throw std::logic_error("[engine] MoE tile map bound exceeded");
      uint32_t* entry = tile_map + static_cast<size_t>(tiles++) * 4;
      entry[0] = static_cast<uint32_t>(e);
      entry[1] = rows + first;
      entry[2] = std::min(static_cast<uint32_t>(s.tile_rows), counts[e] - first);
      entry[3] = 0;
    }
    rows += counts[e];
  }
  expert_offsets[s.experts] = rows;
  *tile_count = tiles;
  // Stable: within an expert, pairs in ascending order (as moe_sort_scatter writes them).
  std::vector<uint32_t> cursor(expert_offsets, expert_offsets + s.experts);
  for (size_t p = 0; p < s.pairs; ++p) sorted_pairs[cursor[ids[p]]++] = static_cast<uint32_t>(p);
}

}  // namespace lily
