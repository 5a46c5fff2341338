// Mixture of experts (reference.py), the CPU twin of metal/moe.metal (decode) and moe_prefill.metal (T rows):
//   moe_route_f32                                softmax, top-k (ties to the lower id), renormalised
//   moe_gate_up_swiglu[_routed]_f32[_sf32]       decode: h = SiLU(gate x) * (up x) of the k experts and the shared
//                                                one (routed: the routing and the post-attention RMSNorm folded in)
//   moe_down_combine_f32[_sf32]                  decode: out = residual + sum_s w_s down_s h_s + sigmoid(g) shared
//   moe_sort_{count,scan,scatter}_u32            T rows: the pairs sorted by expert, the tile map
//   moe_gemm_gate_up_*, moe_gemm_down_*          T rows: one GEMM per expert over its sorted rows
//   moe_combine_f32                              T rows: out = residual + sum_slot expert_out + sigmoid(g) shared
// Experts are 4-bit, as the Metal kernels'. A decode step and T rows share every product and add in the same order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../../../metal/lily.h"
#include "kernels.h"

namespace lily::cpu {

void moe_route(const float* logits, size_t tokens, size_t experts, size_t k, uint32_t* indices, float* weights) {
  std::vector<float> probs(experts);
  std::vector<bool> taken(experts);
  for (size_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    const float max_logit = *std::max_element(l, l + experts);
    float sum = 0;
    for (size_t e = 0; e < experts; ++e) sum += probs[e] = std::exp(l[e] - max_logit);
    for (size_t e = 0; e < experts; ++e) probs[e] /= sum;
    std::fill(taken.begin(), taken.end(), false);
    float chosen_sum = 0;
    for (size_t r = 0; r < k; ++r) {
      size_t best = experts;
      for (size_t e = 0; e < experts; ++e)  // strict > keeps the lower id on a tie
        if (!taken[e] && (best == experts || probs[e] > probs[best])) best = e;
      taken[best] = true;
      indices[t * k + r] = uint32_t(best);
      chosen_sum += weights[t * k + r] = probs[best];
    }
    for (size_t r = 0; r < k; ++r) weights[t * k + r] /= chosen_sum;
  }
}

namespace {

constexpr int kExpertBits = 4;

DType scale_dtype(bool f32_scales) { return f32_scales ? DType::F32 : DType::BF16; }

// out[t] = residual[t] + sum_s parts[s][t] (s ascending) + sigmoid(gate[t]) shared[t]: the one order of the sum.
void combine_row(const float* residual, const float* const* parts, size_t count, float gate, const float* shared,
                 size_t n, float* out) {
  const float g = sigmoid(gate);
  for (size_t i = 0; i < n; ++i) {
    float sum = residual[i];
    for (size_t s = 0; s < count; ++s) sum += parts[s][i];
    out[i] = sum + g * shared[i];
  }
}

// Decode gate/up from buffer `first` on (gate, up, shared gate, shared up; three buffers each) for x and the k
// expert ids: hidden [k I + Is] f32, every product one parallel job.
void gate_up(const KernelCall& c, const MoeArgs& a, bool f32_scales, const float* x, const uint32_t* ids,
             size_t first, float* hidden) {
  const DType sd = scale_dtype(f32_scales);
  const size_t k = a.top_k, I = a.expert_size, Is = a.shared_expert_size, H = a.hidden_size;
  const Matrix gate = c.matrix(first, kExpertBits, sd, a.num_experts, I, H);
  const Matrix up = c.matrix(first + 3, kExpertBits, sd, a.num_experts, I, H);
  Matrix w[kMaxLinearTargets];
  LinearTarget targets[kMaxLinearTargets];
  if (2 * (k + 1) > kMaxLinearTargets) throw std::logic_error("[cpu] moe: top_k above 15");
  thread_local std::vector<float> ups;
  ups.resize(k * I + Is);
  for (size_t s = 0; s < k; ++s) {
    w[2 * s] = gate.expert(ids[s]);
    w[2 * s + 1] = up.expert(ids[s]);
    targets[2 * s] = {&w[2 * s], hidden + s * I, nullptr};
    targets[2 * s + 1] = {&w[2 * s + 1], ups.data() + s * I, nullptr};
  }
  w[2 * k] = c.matrix(first + 6, kExpertBits, sd, 0, Is, H);
  w[2 * k + 1] = c.matrix(first + 9, kExpertBits, sd, 0, Is, H);
  targets[2 * k] = {&w[2 * k], hidden + k * I, nullptr};
  targets[2 * k + 1] = {&w[2 * k + 1], ups.data() + k * I, nullptr};
  linear_many(x, 1, targets, 2 * (k + 1), &c.pool);
  silu(hidden, ups.data(), k * I + Is);
}

void route_kernel(const KernelCall& c) {
  const auto a = c.args<MoeArgs>();
  uint32_t* ids = c.at<uint32_t>(2);
  moe_route(c.at<const float>(1), a.num_rows, a.num_experts, a.top_k, ids, c.at<float>(3));
  c.load.add(c.layer, ids, size_t(a.num_rows) * a.top_k, a.num_experts);
}

void gate_up_kernel(const KernelCall& c, bool f32_scales) {
  const auto a = c.args<MoeArgs>();
  gate_up(c, a, f32_scales, c.at<const float>(1), c.at<const uint32_t>(2), 3, c.at<float>(15));
}

// x is the hidden stream: normed here, routed on the E logits, then gate/up as above.
void gate_up_routed_kernel(const KernelCall& c, bool f32_scales) {
  const auto r = c.args<MoeRoutedArgs>();
  const MoeArgs& a = r.moe;
  thread_local std::vector<float> normed;
  normed.resize(a.hidden_size);
  rms_norm(c.at<const float>(1), 1, a.hidden_size, c.at<const float>(2), r.eps, normed.data());
  uint32_t* ids = c.at<uint32_t>(4);
  moe_route(c.at<const float>(3), 1, a.num_experts, a.top_k, ids, c.at<float>(5));
  c.load.add(c.layer, ids, a.top_k, a.num_experts);
  gate_up(c, a, f32_scales, normed.data(), ids, 6, c.at<float>(18));
}

// hidden, ids, weights, down (3), shared down (3), gate logit, residual, out: buffers 1 to 12.
void down_combine_kernel(const KernelCall& c, bool f32_scales) {
  const auto a = c.args<MoeArgs>();
  const DType sd = scale_dtype(f32_scales);
  const size_t k = a.top_k, I = a.expert_size, Is = a.shared_expert_size, H = a.hidden_size;
  const float* hidden = c.at<const float>(1);
  const uint32_t* ids = c.at<const uint32_t>(2);
  const float* weights = c.at<const float>(3);
  const Matrix down = c.matrix(4, kExpertBits, sd, a.num_experts, H, I);
  Matrix w[kMaxLinearTargets];
  if (k + 1 > kMaxLinearTargets) throw std::logic_error("[cpu] moe: top_k above 31");
  LinearTarget targets[kMaxLinearTargets];
  thread_local std::vector<float> y;
  y.resize((k + 1) * H);
  for (size_t s = 0; s < k; ++s) {
    w[s] = down.expert(ids[s]);
    targets[s] = {&w[s], y.data() + s * H, hidden + s * I};
  }
  w[k] = c.matrix(7, kExpertBits, sd, 0, H, Is);
  targets[k] = {&w[k], y.data() + k * H, hidden + k * I};
  // The routed experts share I columns, the shared one has Is: one job each width.
  linear_many(hidden, 1, targets, k, &c.pool);
  linear_many(hidden, 1, targets + k, 1, &c.pool);
  const float* parts[LILY_MOE_MAX_EXPERTS];
  for (size_t s = 0; s < k; ++s) {
    float* row = y.data() + s * H;
    for (size_t i = 0; i < H; ++i) row[i] *= weights[s];
    parts[s] = row;
  }
  combine_row(c.at<const float>(11), parts, k, c.at<const float>(10)[0], y.data() + k * H, H, c.at<float>(12));
}

size_t sort_blocks(const MoeArgs& a) { return (size_t(a.num_rows) * a.top_k + LILY_MOE_SORT_BLOCK - 1) / LILY_MOE_SORT_BLOCK; }

void sort_count_kernel(const KernelCall& c) {
  const auto a = c.args<MoeArgs>();
  const uint32_t* ids = c.at<const uint32_t>(1);
  uint32_t* counts = c.at<uint32_t>(2);
  const size_t pairs = size_t(a.num_rows) * a.top_k;
  for (size_t b = 0; b < sort_blocks(a); ++b) {
    uint32_t* row = counts + b * a.num_experts;
    std::fill(row, row + a.num_experts, 0u);
    for (size_t p = b * LILY_MOE_SORT_BLOCK; p < std::min(pairs, (b + 1) * LILY_MOE_SORT_BLOCK); ++p)
      if (ids[p] < a.num_experts) ++row[ids[p]];
  }
}

// Block counts become each block's offset within its expert; expert offsets [E + 1]; tiles of tile_rows rows.
void sort_scan_kernel(const KernelCall& c) {
  const auto a = c.args<MoeArgs>();
  uint32_t *counts = c.at<uint32_t>(1), *offsets = c.at<uint32_t>(2), *tile_map = c.at<uint32_t>(3);
  uint32_t row_offset = 0, tile_offset = 0;
  for (size_t e = 0; e < a.num_experts; ++e) {
    uint32_t count = 0;
    for (size_t b = 0; b < sort_blocks(a); ++b) {
      const uint32_t n = counts[b * a.num_experts + e];
      counts[b * a.num_experts + e] = count;
      count += n;
    }
    const uint32_t tiles = (count + a.tile_rows - 1) / a.tile_rows;
    offsets[e] = row_offset;
    for (uint32_t j = 0; j < tiles && tile_offset + j < a.max_tiles; ++j) {
      uint32_t* entry = tile_map + size_t(tile_offset + j) * 4;
      entry[0] = uint32_t(e);
      entry[1] = row_offset + j * a.tile_rows;
      entry[2] = std::min(a.tile_rows, count - j * a.tile_rows);
      entry[3] = 0;
    }
    row_offset += count;
    tile_offset += tiles;
  }
  offsets[a.num_experts] = row_offset;
  c.at<uint32_t>(4)[0] = tile_offset;
}

void sort_scatter_kernel(const KernelCall& c) {
  const auto a = c.args<MoeArgs>();
  const uint32_t *ids = c.at<const uint32_t>(1), *block_offsets = c.at<const uint32_t>(2);
  const uint32_t* offsets = c.at<const uint32_t>(3);
  uint32_t* sorted = c.at<uint32_t>(4);
  const size_t pairs = size_t(a.num_rows) * a.top_k;
  std::vector<uint32_t> rank(a.num_experts);
  for (size_t b = 0; b < sort_blocks(a); ++b) {
    std::fill(rank.begin(), rank.end(), 0u);
    for (size_t p = b * LILY_MOE_SORT_BLOCK; p < std::min(pairs, (b + 1) * LILY_MOE_SORT_BLOCK); ++p) {
      const uint32_t e = ids[p];
      if (e >= a.num_experts) continue;
      sorted[offsets[e] + block_offsets[b * a.num_experts + e] + rank[e]++] = uint32_t(p);
    }
  }
}

// The tile map's tiles merged per expert: (expert, first sorted row, rows), in map order.
struct ExpertRows {
  uint32_t expert, first, rows;
};
std::vector<ExpertRows> expert_rows(const KernelCall& c) {
  const uint32_t* map = c.at<const uint32_t>(3);
  std::vector<ExpertRows> out;
  for (uint32_t t = 0; t < c.at<const uint32_t>(4)[0]; ++t) {
    const uint32_t* entry = map + size_t(t) * 4;
    if (!out.empty() && out.back().expert == entry[0] && out.back().first + out.back().rows == entry[1]) {
      out.back().rows += entry[2];
    } else {
      out.push_back({entry[0], entry[1], entry[2]});
    }
  }
  return out;
}

// fn(group, pool) for every expert group: groups spread over the threads (the largest first, each on one thread),
// or one group given the whole pool.
template <class Fn>
void for_groups(const KernelCall& c, const std::vector<ExpertRows>& groups, size_t work_per_row, Fn fn) {
  if (groups.size() == 1) {
    fn(groups[0], &c.pool);
    return;
  }
  std::vector<size_t> order(groups.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return groups[x].rows > groups[y].rows; });
  size_t rows = 0;
  for (const ExpertRows& g : groups) rows += g.rows;
  const size_t per_group = (rows / groups.size() + 1) * work_per_row;
  c.pool.parallel_for(groups.size(), std::max<size_t>(1, ThreadPool::kMinOps / per_group),
                      [&](size_t begin, size_t end) {
                        for (size_t i = begin; i < end; ++i) fn(groups[order[i]], nullptr);
                      },
                      groups.size());
}

// hidden [T k (sorted), I] = SiLU(x_row gate_e^T) * (x_row up_e^T), x_row the token of each sorted pair.
void gemm_gate_up_kernel(const KernelCall& c, bool f32_scales) {
  const auto a = c.args<MoeArgs>();
  const DType sd = scale_dtype(f32_scales);
  const size_t H = a.hidden_size, I = a.expert_size;
  const float* x = c.at<const float>(1);
  const uint32_t* sorted = c.at<const uint32_t>(2);
  const Matrix gate = c.matrix(5, kExpertBits, sd, a.num_experts, I, H);
  const Matrix up = c.matrix(8, kExpertBits, sd, a.num_experts, I, H);
  float* hidden = c.at<float>(11);
  for_groups(c, expert_rows(c), 3 * I * H, [&](const ExpertRows& g, ThreadPool* pool) {
    thread_local std::vector<float> xs, ups;  // grown once per thread, not once per expert
    xs.resize(size_t(g.rows) * H);
    ups.resize(size_t(g.rows) * I);
    for (size_t r = 0; r < g.rows; ++r) std::copy_n(x + sorted[g.first + r] / a.top_k * H, H, xs.begin() + r * H);
    const Matrix gate_e = gate.expert(g.expert), up_e = up.expert(g.expert);
    float* h = hidden + size_t(g.first) * I;
    float* u = ups.data();  // this thread's, for the pool's workers too
    linear_many(xs.data(), g.rows, {{&gate_e, h, nullptr}, {&up_e, u, nullptr}}, pool);
    silu(h, u, size_t(g.rows) * I);
  });
}

// expert_out [pair, H] = weight[pair] (hidden_row down_e^T): back in pair order.
void gemm_down_kernel(const KernelCall& c, bool f32_scales) {
  const auto a = c.args<MoeArgs>();
  const DType sd = scale_dtype(f32_scales);
  const size_t H = a.hidden_size, I = a.expert_size;
  const float* hidden = c.at<const float>(1);
  const uint32_t* sorted = c.at<const uint32_t>(2);
  const float* weights = c.at<const float>(5);
  const Matrix down = c.matrix(6, kExpertBits, sd, a.num_experts, H, I);
  float* out = c.at<float>(9);
  for_groups(c, expert_rows(c), 2 * I * H, [&](const ExpertRows& g, ThreadPool* pool) {
    thread_local std::vector<float> ys;
    ys.resize(size_t(g.rows) * H);
    float* y = ys.data();
    linear(hidden + size_t(g.first) * I, g.rows, down.expert(g.expert), y, pool);
    for (size_t r = 0; r < g.rows; ++r) {
      const uint32_t pair = sorted[g.first + r];
      for (size_t i = 0; i < H; ++i) out[size_t(pair) * H + i] = y[r * H + i] * weights[pair];
    }
  });
}

// expert_out [T k, H], shared_out [T, H], gate logits [T], residual, out: buffers 1 to 5.
void combine_kernel(const KernelCall& c) {
  const auto a = c.args<MoeArgs>();
  const size_t k = a.top_k, H = a.hidden_size;
  const float *expert_out = c.at<const float>(1), *shared = c.at<const float>(2), *gate = c.at<const float>(3);
  const float* residual = c.at<const float>(4);
  float* out = c.at<float>(5);
  c.pool.for_items(a.num_rows, (k + 2) * H, [&](size_t t0, size_t t1) {
    const float* parts[LILY_MOE_MAX_EXPERTS];
    for (size_t t = t0; t < t1; ++t) {
      for (size_t s = 0; s < k; ++s) parts[s] = expert_out + (t * k + s) * H;
      combine_row(residual + t * H, parts, k, gate[t], shared + t * H, H, out + t * H);
    }
  });
}

}  // namespace

void add_moe_kernels(KernelTable& table) {
  table.add("moe_route_f32", route_kernel);
  table.add("moe_sort_count_u32", sort_count_kernel);
  table.add("moe_sort_scan_u32", sort_scan_kernel);
  table.add("moe_sort_scatter_u32", sort_scatter_kernel);
  table.add("moe_combine_f32", combine_kernel);
  for (bool f32 : {false, true}) {
    const std::string s = f32 ? "_sf32" : "";
    table.add("moe_gate_up_swiglu_f32" + s, [f32](const KernelCall& c) { gate_up_kernel(c, f32); });
    table.add("moe_gate_up_swiglu_routed_f32" + s, [f32](const KernelCall& c) { gate_up_routed_kernel(c, f32); });
    table.add("moe_down_combine_f32" + s, [f32](const KernelCall& c) { down_combine_kernel(c, f32); });
    for (const char* bm : {"_bm16", "_bm32"}) {
      table.add("moe_gemm_gate_up_f32" + s + bm, [f32](const KernelCall& c) { gemm_gate_up_kernel(c, f32); });
      table.add("moe_gemm_down_f32" + s + bm, [f32](const KernelCall& c) { gemm_down_kernel(c, f32); });
    }
  }
}

}  // namespace lily::cpu
