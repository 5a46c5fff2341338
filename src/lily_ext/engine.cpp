// The engine: checkpoint files, state, load -> prefill -> decode over the graphs, through a Runtime (see model.h).
#include "model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "layout_probe.h"
#include "ops/ops.h"
#include "plan.h"
#include "tuning.h"

namespace lily {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

// ---- the engine ----

Engine::Engine(const ModelConfig& config, Precision precision, const Switches& switches, size_t max_context,
               std::unique_ptr<Runtime> runtime)
    : config_(config), precision_(precision), switches_(switches), max_context_(max_context),
      runtime_(std::move(runtime)) {
  config_.validate();
  if (!runtime_->kernels_for_any_shape()) config_.check_kernel_shapes();
  if (max_context_ == 0) throw Error("[engine] max_context must be positive");
  runtime_->restrict_switches(switches_);
  switches_.tensor_ops = switches_.tensor_ops && runtime_->supports_tensor_ops();
  switches_.staged_gemv = switches_.staged_gemv && runtime_->prefers_staged_gemv();
  switches_.mma_gemv = switches_.mma_gemv && runtime_->prefers_mma_gemv();
  if (!switches_.split_kv_block_keys && runtime_->prefers_short_split_blocks()) {
    switches_.split_kv_block_keys = tuning::kAttentionSplitShortBlockKeys;
  }
  if ((switches_.mma_attention || switches_.mma_gemv) && !simdgroup_layout_matches(*runtime_)) {
    std::fprintf(stderr, "lily: this GPU's simdgroup_matrix lane layout differs from the one the matrix-unit kernels "
                         "assume; attention and few-row GEMVs use the vector kernels\n");
    switches_.mma_attention = false;
    switches_.mma_gemv = false;
  }
}

Engine::~Engine() {
  // The work in flight finishes, and goes with the recordings, before the buffers it uses.
  for (InFlight& f : in_flight_) {
    try {
      f.work->wait();
    } catch (const Error&) {
      // Its failure was the caller's to see; here only its end matters.
    }
  }
  in_flight_.clear();
  programs_.clear();
  buffers_.clear();
}

int Engine::add_buffer(const std::string& name, BufferRole role, std::unique_ptr<DeviceBuffer> buffer) {
  int id = base_.add_buffer(name, buffer->length(), role);
  buffers_.push_back(std::move(buffer));
  return id;
}

DeviceMemory Engine::device_memory() const {
  DeviceMemory m;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const int id = static_cast<int>(i);
    if (std::find(reserved_buffers_.begin(), reserved_buffers_.end(), id) != reserved_buffers_.end()) continue;
    m.add(state_, id, base_.buffers[i].role, buffers_[i]->length());
  }
  m.peak = std::max(peak_bytes_, m.total());
  return m;
}

void Engine::note_memory(uint64_t transient) {
  peak_bytes_ = std::max(peak_bytes_, device_memory().total() + transient);
}

int Engine::add_file(const std::string& path) {
  return add_buffer(path, BufferRole::Weights, runtime_->load_file(path));
}

size_t Engine::buffer_origin(int id) const {
  if (id < 0 || static_cast<size_t>(id) >= buffers_.size()) throw Error("[engine] no buffer " + std::to_string(id));
  return buffers_[id]->origin();
}

int Engine::add_owned(const void* data, size_t length) {
  int id = add_buffer("materialised weights", BufferRole::Weights, runtime_->allocate(length, Memory::Device));
  runtime_->upload(*buffers_.back(), 0, data, length);
  owned_bytes_ += length;
  return id;
}

int Engine::add_reserved(size_t length) {
  reserved_buffers_.push_back(static_cast<int>(buffers_.size()));
  return add_buffer("reserved weights", BufferRole::Weights, runtime_->reserve(length));
}

void Engine::bind_synthetic_weights() {
  Graph layout;
  WeightTable table = synthetic_weights(config_, layout);
  // Twice the layout: float32 mode reads the bf16 tensors as f32 (twice the bytes; nothing is ever read).
  const int id = add_reserved(2 * layout.buffers.at(0).length);
  for (auto& [name, ref] : table) {
    for (Span* span : {&ref.data, &ref.scales, &ref.biases}) span->buffer = id;
    if (!ref.bits && ref.dtype == DType::BF16 && precision_ == Precision::Float32) {
      ref.dtype = DType::F32;
      ref.data.length *= 2;
    }
    bind_weight(name, ref);
  }
}

// `ref`'s spans are byte ranges of the files as written; each moves by where its buffer put the file's byte 0. A span
// still not aligned to its elements (a writer that does not pad tensors: MLX after an odd-sized bf16 tensor) is copied
// into a buffer of its own, since a GPU reads an element only at an address aligned to its size (the fake Metal and
// fake libcuda check that per kernel argument); a runtime that reads unaligned (the CPU's) binds it in place.
void Engine::bind_weight(const std::string& name, const WeightRef& ref) {
  if (loaded_) throw Error("[engine] " + name + ": weights are bound before finish_loading");
  WeightRef placed = ref;
  for (Span* span : {&placed.data, &placed.scales, &placed.biases}) {
    if (span->length == 0 && span != &placed.data) continue;
    if (span->buffer < 0 || static_cast<size_t>(span->buffer) >= buffers_.size()) {
      throw Error("[engine] " + name + ": its byte range is not inside a loaded file or buffer");
    }
    span->offset += buffers_[span->buffer]->origin();
    if (span->offset + span->length > base_.buffers[span->buffer].length) {
      throw Error("[engine] " + name + ": its byte range is not inside a loaded file or buffer");
    }
    const size_t alignment = dtype_size(span == &placed.data ? (ref.bits ? DType::U32 : ref.dtype) : ref.scale_dtype);
    if (span->offset % alignment && !runtime_->reads_unaligned()) {
      const DeviceBuffer& source = *buffers_[span->buffer];
      const int id = add_buffer("realigned " + name, BufferRole::Weights,
                                runtime_->allocate(span->length, Memory::Device));
      runtime_->copy(source, span->offset, *buffers_.back(), 0, span->length);
      owned_bytes_ += span->length;
      span->buffer = id;
      span->offset = 0;
    }
  }
  if (ref.bits && ref.cols % 64) throw Error("[engine] " + name + ": input features must be a multiple of 64");
  weights_[name] = placed;
}

void Engine::finish_loading() {
  // Dense tensors are read by kernels templated on the activation dtype, except A_log and dt_bias (always f32).
  const DType act = precision_ == Precision::Float32 ? DType::F32 : DType::BF16;
  for (const auto& [name, w] : weights_) {
    // The MoE kernels read 4-bit experts (metal/moe*.metal, and the CPU runtime's): anything else is refused here.
    if (w.experts && w.bits != 4) {
      throw Error("[engine] " + name + ": the MoE kernels take 4-bit experts; got " +
                  (w.bits ? std::to_string(w.bits) + "-bit" : std::string("dense")) + " weights");
    }
    if (w.bits) continue;
    DType wanted = ends_with(name, "A_log") || ends_with(name, "dt_bias") ? DType::F32 : act;
    if (w.dtype != wanted) {
      throw Error("[engine] " + name + " must be bound as " + dtype_name(wanted) + " for this precision; got " +
                       dtype_name(w.dtype));
    }
  }
  size_t first_new = base_.buffers.size();
  state_ = add_state_buffers(config_, precision_, std::min(max_context_, switches_.kv_growth_block()), base_);
  step_ = add_pass_buffers(config_, precision_, 1, 1, max_context_, "", base_);
  for (size_t i = first_new; i < base_.buffers.size(); ++i) buffers_.push_back(allocate(base_.buffers[i]));
  note_memory();  // loading only adds buffers: what is held now is the most held so far
  // A dry build names any missing tensor now rather than at the first token.
  Graph probe;
  probe.buffers = base_.buffers;
  build_decode_step(config_, precision_, switches_, weights_, state_, step_, 0, 0, 1, probe);
  // Every decode pipeline is built now: a kernel missing for this checkpoint's quantization is named at load, and
  // the first token does not pay for compilation.
  for (const Node& node : probe.nodes) runtime_->require_kernel(node.kernel);
  loaded_ = true;
  reset();
}

void Engine::reset() {
  for (size_t i = 0; i < base_.buffers.size(); ++i) {
    if (base_.buffers[i].role == BufferRole::State || base_.buffers[i].role == BufferRole::Io) {
      runtime_->fill_zero(*buffers_[i]);
    }
  }
  position_ = 0;
}

void Engine::ensure_capacity(size_t keys) {
  if (keys > max_context_) {
    throw Error("[engine] the context limit is " + std::to_string(max_context_) + " tokens; this call needs " +
                     std::to_string(keys));
  }
  const size_t old_capacity = state_.kv_capacity;
  if (keys <= old_capacity) return;
  const size_t capacity = std::min(round_up(keys, switches_.kv_growth_block()), max_context_);
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;  // one head
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    for (int id : {state_.k_cache[layer], state_.v_cache[layer]}) {
      if (id < 0) continue;
      std::unique_ptr<DeviceBuffer> grown = runtime_->allocate(config_.num_kv_heads * capacity * row, Memory::Device);
      note_memory(grown->length());
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        runtime_->copy(*buffers_[id], h * old_capacity * row, *grown, h * capacity * row, position_ * row);
      }
      buffers_[id] = std::move(grown);
      base_.buffers[id].length = buffers_[id]->length();
    }
  }
  state_.kv_capacity = capacity;
  // Steps recorded over the old caches are not coming back (the capacity only grows).
  programs_.erase(std::remove_if(programs_.begin(), programs_.end(),
                                 [&](const Program& p) { return p.kv_capacity != capacity; }),
                  programs_.end());
}


// ---- the decode step: built once per shape, re-encoded per token ----

size_t Engine::split_blocks(size_t position) const {
  return ops::attention_split_blocks(switches_, position + 1);
}

// The step for this token slot, choice and shape (KV capacity, split-KV blocks at this position): found among the
// programs built so far, else built now. Nothing in it is looked up by name per token.
Engine::Program& Engine::program(int token_slot, const std::optional<TokenChoice>& choice) {
  const size_t blocks = split_blocks(position_);
  for (Program& p : programs_) {
    if (p.rows == 1 && p.token_slot == token_slot && p.kv_capacity == state_.kv_capacity && p.split_blocks == blocks &&
        p.choice == choice) {
      return p;
    }
  }
  auto graph = std::make_shared<Graph>();
  graph->buffers = base_.buffers;
  build_decode_step(config_, precision_, switches_, weights_, state_, step_, position_, token_slot, 1 - token_slot,
                    *graph, choice);
  Program built;
  built.token_slot = token_slot;
  built.kv_capacity = state_.kv_capacity;
  built.split_blocks = blocks;
  built.choice = choice;
  built.graph = graph;
  return keep(std::move(built));
}

// The pass of a short prompt chunk of `rows` tokens from chunk_.ids with logits for its last `logit_rows` rows, at
// any position with this KV capacity and split-KV block count: found among the programs built so far, else built now.
Engine::Program& Engine::short_pass(size_t rows, size_t logit_rows) {
  const size_t blocks = ops::attention_prefill_split_blocks(switches_, config_, rows, position_ + rows);
  for (Program& p : programs_) {
    if (p.rows == rows && p.logit_rows == logit_rows && p.kv_capacity == state_.kv_capacity &&
        p.split_blocks == blocks) {
      return p;
    }
  }
  auto graph = std::make_shared<Graph>();
  graph->buffers = base_.buffers;
  build_forward(config_, precision_, switches_, weights_, state_, chunk_, chunk_input(rows, logit_rows), *graph);
  Program built;
  built.rows = rows;
  built.logit_rows = logit_rows;
  built.kv_capacity = state_.kv_capacity;
  built.split_blocks = blocks;
  built.graph = graph;
  return keep(std::move(built));
}

// Records a program built now and keeps it among the few shapes that live at once (two token slots, with and
// without a choice, a few prompt lengths); older shapes are not coming back.
Engine::Program& Engine::keep(Program built) {
  built.recorded = runtime_->record(built.graph, 0, built.graph->nodes.size(), buffer_list(), {/*replayed=*/true, -1});
  ++programs_built_;
  if (programs_.size() >= 16) programs_.erase(programs_.begin());
  programs_.push_back(std::move(built));
  return programs_.back();
}

// Submits a decode step at the current position. A dropped barrier (tests) records the step once more without it.
std::unique_ptr<Submission> Engine::submit_program(const Program& program, long dropped_barrier) {
  std::shared_ptr<RecordedGraph> recorded = program.recorded;
  if (dropped_barrier >= 0) {
    recorded = runtime_->record(program.graph, 0, program.graph->nodes.size(), buffer_list(),
                                {/*replayed=*/true, dropped_barrier});
  }
  last_graph_ = program.graph;
  return runtime_->submit(recorded, position_);
}

std::vector<DeviceBuffer*> Engine::buffer_list() const {
  std::vector<DeviceBuffer*> out;
  out.reserve(buffers_.size());
  for (const auto& b : buffers_) out.push_back(b.get());
  return out;
}

std::unique_ptr<DeviceBuffer> Engine::allocate(const GraphBuffer& b) const {
  // Token ids are what the host reads while steps are in flight; everything else stays on the GPU.
  return runtime_->allocate(b.length, b.role == BufferRole::Io && b.name == "tokens" ? Memory::HostVisible
                                                                                       : Memory::Device);
}

void Engine::run_graph(Graph graph, long dropped_barrier) {
  auto shared = std::make_shared<const Graph>(std::move(graph));
  const std::vector<DeviceBuffer*> buffers = buffer_list();
  size_t begin = 0;
  auto run = [&](size_t end) {
    const RecordOptions options{/*replayed=*/false, dropped_barrier, profiling_};
    std::unique_ptr<Submission> submitted = runtime_->submit(runtime_->record(shared, begin, end, buffers, options),
                                                             position_);
    submitted->wait();
    if (profiling_) {
      const std::vector<double> ms = submitted->node_milliseconds();
      for (size_t i = begin; i < end; ++i) {
        node_times_.push_back({shared->nodes[i].kernel, shared->nodes[i].label, ms.at(i - begin)});
      }
    }
    begin = end;
  };
  for (const HostMoeSort& sort : shared->host_sorts) {
    run(sort.before_node);
    run_host_sort(sort);
  }
  run(shared->nodes.size());
  last_graph_ = std::move(shared);
}

void Engine::set_profiling(bool on) {
  if (on && !runtime_->supports_profiling()) {
    throw Error(std::string("[engine] per-node device times need the cuda runtime; the ") + runtime_->name() +
                " runtime does not report them yet");
  }
  profiling_ = on;
}

void Engine::run_host_sort(const HostMoeSort& sort) {
  std::vector<std::vector<uint32_t>> tables;
  for (const Span* span : {&sort.expert_ids, &sort.expert_offsets, &sort.tile_map, &sort.tile_count,
                           &sort.sorted_pairs}) {
    tables.emplace_back(span->length / 4);
  }
  runtime_->download(*buffers_[sort.expert_ids.buffer], sort.expert_ids.offset, tables[0].data(),
                     sort.expert_ids.length);
  host_moe_sort(sort, tables[0].data(), tables[1].data(), tables[2].data(), tables[3].data(), tables[4].data());
  size_t t = 1;
  for (const Span* span : {&sort.expert_offsets, &sort.tile_map, &sort.tile_count, &sort.sorted_pairs}) {
    runtime_->upload(*buffers_[span->buffer], span->offset, tables[t++].data(), span->length);
  }
}

// Logits are f32 in every precision (lm_head writes them so: rounded to bf16, near-equal logits tie).
void Engine::read_rows(int buffer_id, size_t rows, float* out) {
  const size_t n = rows * config_.vocab_size;
  host_read_bytes_ += n * 4;
  runtime_->download(*buffers_.at(static_cast<size_t>(buffer_id)), 0, out, n * 4);
}

// The decode logits buffer from host logits (the last row of a prefill).
void Engine::write_logits(const float* logits) {
  runtime_->upload(*buffers_[step_.logits], 0, logits, config_.vocab_size * 4);
}

void Engine::ensure_chunk_rows(size_t rows, size_t logit_rows) {
  if (has_chunk_ && chunk_.rows >= rows && chunk_.logit_rows >= logit_rows) return;
  // The chunk scratch is the last group of buffers: a larger chunk (or logits for more rows) replaces the group
  // (same ids, new sizes), which never shrinks in either.
  if (has_chunk_) {
    rows = std::max(rows, chunk_.rows);
    logit_rows = std::max(logit_rows, chunk_.logit_rows);
    base_.buffers.erase(base_.buffers.begin() + static_cast<long>(chunk_first_buffer_), base_.buffers.end());
    buffers_.erase(buffers_.begin() + static_cast<long>(chunk_first_buffer_), buffers_.end());
  }
  chunk_first_buffer_ = base_.buffers.size();
  chunk_ = add_pass_buffers(config_, precision_, rows, logit_rows, max_context_, "prefill", base_);
  if (!switches_.in_gemm_dequant) chunk_.dequant = add_dequant_scratch(precision_, weights_, base_);
  if (switches_.chunked_scan) chunk_.gdn_chunks = add_gdn_chunk_scratch(config_, rows, base_);
  for (size_t i = chunk_first_buffer_; i < base_.buffers.size(); ++i) {
    buffers_.push_back(allocate(base_.buffers[i]));
  }
  note_memory();
  has_chunk_ = true;
  programs_.clear();  // the decode steps hold the buffer list they were built over
}

// A chunk of `rows` token ids from chunk_.ids at the current position, with logits for its last `logit_rows` rows.
PassInput Engine::chunk_input(size_t rows, size_t logit_rows) const {
  PassInput in;
  in.position = position_;
  in.tokens = rows;
  in.logit_rows = logit_rows;
  in.ids = Span{chunk_.ids, 0, rows * 4};
  return in;
}

void Engine::prefill_chunk(const uint32_t* tokens, size_t count, float* logits, size_t logit_rows,
                           long dropped_barrier) {
  const size_t chunk = switches_.prefill_chunk ? switches_.prefill_chunk : tuning::kPrefillChunk;
  const size_t rows = std::max(count, std::min(chunk, max_context_));
  // Logits for the last row only, or (every row's) for a whole chunk of up to kPrefillLogitRows at once, so that
  // later chunks of any length up to that reuse the buffers.
  const size_t logit_capacity =
      logit_rows <= 1 ? logit_rows : std::max(logit_rows, std::min(rows, tuning::kPrefillLogitRows));
  ensure_chunk_rows(rows, logit_capacity);
  auto put = [&](int id, const void* data, size_t bytes) { runtime_->upload(*buffers_[id], 0, data, bytes); };
  put(chunk_.ids, tokens, count * 4);
  if (count > 1) {
    SharedExpertRouting routing = shared_expert_routing(count, switches_.wide_tiles);
    put(chunk_.shared_pairs, routing.pairs.data(), routing.pairs.size() * 4);
    put(chunk_.ones, routing.ones.data(), routing.ones.size() * 4);
    put(chunk_.shared_tile_map, routing.tile_map.data(), routing.tile_map.size() * 4);
    put(chunk_.shared_tile_count, &routing.tile_count, 4);
  }
  // A short chunk (a chat turn's prompt, a tool result) runs a pass recorded once per length and replayed, as a
  // decode step is: building and launching it node by node cost the host as much as the GPU's work at 8 rows. Not
  // with the CPU's MoE sort (a round trip inside the pass) or per-node profiling.
  if (switches_.replayed_prompts && count > 1 && count <= tuning::kReplayedPromptMaxRows && switches_.gpu_routing &&
      !profiling_) {
    submit_program(short_pass(count, logit_rows), dropped_barrier)->wait();
  } else {
    Graph graph;
    graph.buffers = base_.buffers;
    build_forward(config_, precision_, switches_, weights_, state_, chunk_, chunk_input(count, logit_rows), graph);
    run_graph(std::move(graph), dropped_barrier);
  }
  if (logit_rows) read_rows(chunk_.logits, logit_rows, logits);
  position_ += count;
}

void Engine::require_idle(const char* what) const {
  if (!loaded_) throw Error(std::string("[engine] ") + what + " before finish_loading");
  if (decoding_) throw Error(std::string("[engine] ") + what + " while a decode is running (end_decode first)");
}

void Engine::forward(const std::vector<uint32_t>& tokens, float* logits, long dropped_barrier, bool last_only) {
  require_idle("forward");
  for (uint32_t token : tokens) {
    if (token >= config_.vocab_size) {
      throw Error("[engine] token id " + std::to_string(token) + " is not below vocab_size " +
                       std::to_string(config_.vocab_size));
    }
  }
  ensure_capacity(position_ + tokens.size());
  const size_t V = config_.vocab_size;
  if (switches_.batched_prefill && tokens.size() > 1) {
    // Every row's logits (a prompt's log-probabilities): chunks of at most kPrefillLogitRows, so that their [T, V]
    // f32 logits stay near 500 MB at full size.
    const size_t limit = std::min(switches_.prefill_chunk ? switches_.prefill_chunk : tuning::kPrefillChunk,
                                  last_only ? max_context_ : tuning::kPrefillLogitRows);
    const size_t chunk = !switches_.chunked_prefill ? tokens.size() : std::min(limit, max_context_);
    for (size_t start = 0; start < tokens.size(); start += chunk) {
      const size_t count = std::min(chunk, tokens.size() - start);
      const bool last_chunk = start + count == tokens.size();
      prefill_chunk(tokens.data() + start, count, last_only ? logits : logits + start * V,
                    last_only ? (last_chunk ? 1 : 0) : count, dropped_barrier);
    }
    return;
  }
  // One decode step per token, no token choice (the caller reads logits).
  for (size_t t = 0; t < tokens.size(); ++t) {
    runtime_->upload(*buffers_[state_.tokens], 0, &tokens[t], 4);
    submit_program(program(0, std::nullopt), dropped_barrier)->wait();
    ++position_;
    if (!last_only) {
      read_rows(step_.logits, 1, logits + t * V);
    } else if (t + 1 == tokens.size()) {
      read_rows(step_.logits, 1, logits);
    }
  }
}

// ---- decode on the GPU: the token chosen in the step, steps in flight ----

void Engine::begin_decode(const float* last_logits, const TokenChoice& choice, const PenaltyInputs& penalties) {
  require_idle("begin_decode");
  if (!switches_.gpu_token) throw Error("[engine] decoding on the GPU needs the GPU_TOKEN switch on");
  // lily.sampling.SamplingParams checks every field for the user; this guards C++ callers only.
  if (!(choice.temperature >= 0.0f) || !(choice.top_p > 0.0f && choice.top_p <= 1.0f) ||
      !(choice.min_p >= 0.0f && choice.min_p <= 1.0f)) {
    throw std::logic_error("[engine] begin_decode: token choice out of range (temperature >= 0, top_p in (0, 1], "
                           "min_p in [0, 1])");
  }
  if (choice.penalized()) write_penalty_tables(choice, penalties);
  write_logits(last_logits);
  choice_ = choice;
  decoding_ = true;
  // The first token: the choice alone, over the uploaded logits, into slot 0 (a graph of one or two nodes).
  auto graph = std::make_shared<Graph>();
  graph->buffers = base_.buffers;
  build_token_choice(config_, choice, state_, Span{step_.logits, 0, config_.vocab_size * 4}, position_, 0, 0, *graph);
  std::shared_ptr<RecordedGraph> recorded =
      runtime_->record(graph, 0, graph->nodes.size(), buffer_list(), {/*replayed=*/false, -1});
  in_flight_.push_back({runtime_->submit(recorded, position_), 0});
  next_slot_ = 0;
}

// The tables penalize_logits reads: the dense logit bias, the ids the repetition penalty applies to (the context),
// and zero counts (nothing chosen yet in this decode).
void Engine::write_penalty_tables(const TokenChoice& choice, const PenaltyInputs& penalties) {
  const size_t V = config_.vocab_size;
  auto check_ids = [&](const std::vector<uint32_t>& ids, const char* what) {
    for (uint32_t id : ids) {
      if (id >= V) {
        throw Error(std::string("[engine] ") + what + " token id " + std::to_string(id) + " is not below vocab_size " +
                    std::to_string(V));
      }
    }
  };
  check_ids(penalties.bias_ids, "logit_bias");
  check_ids(penalties.context, "context");
  if (penalties.bias_ids.size() != penalties.bias_values.size()) {
    throw Error("[engine] logit_bias ids and values differ in length");
  }
  if (choice.logit_bias) {
    std::vector<float> bias(V, 0.0f);
    for (size_t i = 0; i < penalties.bias_ids.size(); ++i) bias[penalties.bias_ids[i]] += penalties.bias_values[i];
    runtime_->upload(*buffers_[state_.logit_bias], 0, bias.data(), V * 4);
  }
  std::vector<uint32_t> seen(V, 0);
  if (choice.repetition_penalty != 1.0f) {
    for (uint32_t id : penalties.context) seen[id] = 1;
  }
  runtime_->upload(*buffers_[state_.seen_tokens], 0, seen.data(), V * 4);
  runtime_->fill_zero(*buffers_[state_.token_counts]);
}

void Engine::submit_step() {
  if (!decoding_) throw Error("[engine] submit_step before begin_decode");
  // Two slots: the step committed now overwrites the slot of the choice two back, which the host must have read.
  if (in_flight_.size() >= 2) throw std::logic_error("[engine] submit_step with two command buffers in flight");
  if (position_ + 1 > state_.kv_capacity) {
    wait_in_flight();  // a growth re-allocates the caches the steps in flight use
    ensure_capacity(position_ + 1);
  }
  using Clock = std::chrono::steady_clock;
  auto ns = [](Clock::time_point a, Clock::time_point b) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  };
  if (time_cpp_ && step_cpp_ns_.size() < kHostTimingSteps) {
    const auto start = Clock::now();
    Program& p = program(next_slot_, choice_);
    runtime_->submit_dry(*p.recorded, position_);
    step_cpp_ns_.push_back(ns(start, Clock::now()));
  }
  const auto start = Clock::now();
  std::unique_ptr<Submission> work = submit_program(program(next_slot_, choice_), -1);
  if (time_encode_ && step_encode_ns_.size() < kHostTimingSteps) step_encode_ns_.push_back(ns(start, Clock::now()));
  in_flight_.push_back({std::move(work), 1 - next_slot_});
  next_slot_ = 1 - next_slot_;
  ++position_;
}

uint32_t Engine::next_token() {
  if (in_flight_.empty()) throw Error("[engine] next_token with nothing in flight (submit_step first)");
  InFlight done = std::move(in_flight_.front());
  in_flight_.pop_front();
  done.work->wait();
  host_read_bytes_ += 4;
  uint32_t token = 0;
  runtime_->download(*buffers_[state_.tokens], static_cast<size_t>(done.slot) * 4, &token, 4);
  return token;
}

void Engine::wait_in_flight() {
  for (InFlight& f : in_flight_) f.work->wait();
}

void Engine::end_decode() {
  wait_in_flight();
  in_flight_.clear();
  decoding_ = false;
}

void Engine::read_logits(float* out) {
  require_idle("read_logits");
  read_rows(step_.logits, 1, out);
}

std::vector<uint32_t> Engine::generate_greedy(uint32_t first, size_t count) {
  if (first >= config_.vocab_size) throw Error("[engine] token id " + std::to_string(first) + " is out of range");
  // The first token's logits: a one-hot row, so the greedy choice is `first` itself.
  std::vector<float> one_hot(config_.vocab_size, 0.0f);
  one_hot[first] = 1.0f;
  begin_decode(one_hot.data(), TokenChoice{});
  std::vector<uint32_t> out;
  try {
    for (size_t k = 0; k < count; ++k) {
      submit_step();
      uint32_t token = next_token();
      if (k > 0) out.push_back(token);
    }
    if (count) out.push_back(next_token());
  } catch (...) {
    end_decode();
    throw;
  }
  end_decode();
  return out;
}

size_t Engine::snapshot_bytes(size_t position) const {
  StateLayout s = state_layout(config_, precision_);
  size_t total = 0;
  for (bool attention : config_.attention_layers) {
    total += attention ? 2 * position * s.kv_bytes_per_row : s.conv_bytes + s.recurrent_bytes;
  }
  return total;
}

std::vector<unsigned char> Engine::snapshot() const {
  std::vector<unsigned char> out;
  out.reserve(snapshot_bytes(position_));
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    if (!config_.attention_layers[layer]) {
      for (int id : {state_.conv_state[layer], state_.recurrent_state[layer]}) {
        const size_t at = out.size();
        out.resize(at + base_.buffers[id].length);
        runtime_->download(*buffers_[id], 0, out.data() + at, base_.buffers[id].length);
      }
      continue;
    }
    for (int id : {state_.k_cache[layer], state_.v_cache[layer]}) {
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        const size_t at = out.size();
        out.resize(at + position_ * row);
        runtime_->download(*buffers_[id], h * state_.kv_capacity * row, out.data() + at, position_ * row);
      }
    }
  }
  return out;
}

void Engine::restore(const unsigned char* snapshot, size_t length, size_t position) {
  if (length != snapshot_bytes(position)) {
    throw Error("[engine] snapshot of " + std::to_string(length) + " bytes does not match " +
                     std::to_string(position) + " tokens of this model's state");
  }
  position_ = 0;
  ensure_capacity(std::max<size_t>(position, 1));
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;
  const unsigned char* p = snapshot;
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    if (!config_.attention_layers[layer]) {
      for (int id : {state_.conv_state[layer], state_.recurrent_state[layer]}) {
        runtime_->upload(*buffers_[id], 0, p, base_.buffers[id].length);
        p += base_.buffers[id].length;
      }
      continue;
    }
    for (int id : {state_.k_cache[layer], state_.v_cache[layer]}) {
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        runtime_->upload(*buffers_[id], h * state_.kv_capacity * row, p, position * row);
        p += position * row;
      }
    }
  }
  position_ = position;
}

}  // namespace lily
