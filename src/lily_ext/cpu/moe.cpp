// moe_route and swiglu_experts (reference.py "Mixture of experts"), the CPU twin of metal/moe*.metal: the tokens
// of each expert are gathered and run as one small GEMM per projection, experts spread over the threads.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

void moe_route(const float* logits, size_t tokens, size_t experts, size_t k, int32_t* indices, float* weights) {
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
      indices[t * k + r] = int32_t(best);
      chosen_sum += weights[t * k + r] = probs[best];
    }
    for (size_t r = 0; r < k; ++r) weights[t * k + r] /= chosen_sum;
  }
}

void swiglu_experts(const float* x, size_t tokens, size_t hidden, const Matrix& gate_proj, const Matrix& up_proj,
                    const Matrix& down_proj, const int32_t* indices, const float* weights, size_t k, float* out,
                    ThreadPool* pool) {
  const size_t width = gate_proj.rows;
  // Slots (token * k + rank) grouped by expert.
  std::vector<std::vector<size_t>> slots(gate_proj.experts);
  for (size_t slot = 0; slot < tokens * k; ++slot) slots[size_t(indices[slot])].push_back(slot);
  // The experts with the most tokens first, one range each (at few tokens per expert their costs differ by
  // multiples), so the threads end together.
  std::vector<size_t> used;
  for (size_t e = 0; e < slots.size(); ++e)
    if (!slots[e].empty()) used.push_back(e);
  std::stable_sort(used.begin(), used.end(), [&](size_t a, size_t b) { return slots[a].size() > slots[b].size(); });
  Scratch y(tokens * k * hidden);  // each slot's expert output (every slot has one expert, which writes it)
  auto run_experts = [&](size_t begin, size_t end) {
    thread_local std::vector<float> xs, gate, up, ys;  // grown once per thread, not once per expert
    for (size_t i = begin; i < end; ++i) {
      const size_t e = used[i], n = slots[e].size();
      xs.resize(n * hidden);
      for (size_t j = 0; j < n; ++j)
        std::copy_n(x + slots[e][j] / k * hidden, hidden, xs.begin() + j * hidden);
      gate.resize(n * width);
      up.resize(n * width);
      ys.resize(n * hidden);
      const Matrix gate_e = gate_proj.expert(e), up_e = up_proj.expert(e);
      linear_many(xs.data(), n, {{&gate_e, gate.data()}, {&up_e, up.data()}}, nullptr);
      silu(gate.data(), up.data(), n * width);
      linear(gate.data(), n, down_proj.expert(e), ys.data(), nullptr);
      for (size_t j = 0; j < n; ++j) std::copy_n(ys.begin() + j * hidden, hidden, y.data() + slots[e][j] * hidden);
    }
  };
  const size_t per_expert = (tokens * k / std::max<size_t>(used.size(), 1) + 1) * 3 * width * hidden;
  if (pool)
    pool->parallel_for(used.size(), std::max<size_t>(1, ThreadPool::kMinOps / per_expert), run_experts, used.size());
  else run_experts(0, used.size());
  // Weighted sum in rank order.
  auto combine = [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) weighted_sum(weights + t * k, y.data() + t * k * hidden, k, hidden, hidden,
                                                      out + t * hidden);
  };
  if (pool) pool->for_items(tokens, k * hidden, combine);
  else combine(0, tokens);
}

}  // namespace lily::cpu
