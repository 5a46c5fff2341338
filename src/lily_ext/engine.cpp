// The engine: mapped checkpoint files, state buffers, and load -> prefill -> decode over the graphs (see model.h).
#include "model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "encoder.h"
#include "layout_probe.h"
#include "plan.h"
#include "tuning.h"

namespace lily {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

// ---- mapped files ----

namespace {

// Apple silicon's page size: newBufferWithBytesNoCopy wants the pointer and the length aligned to it.
constexpr size_t kMetalPage = 16384;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

MappedFile::MappedFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw mtl::Error("[engine] cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    throw mtl::Error("[engine] " + path + " is empty or cannot be read");
  }
  file_length_ = static_cast<size_t>(st.st_size);
  mapped_length_ = round_up(file_length_, kMetalPage);
  // Reserve one extra page so the file can be placed at a 16 KB boundary; the reservation's zero pages pad the
  // mapping to whole pages.
  reservation_length_ = mapped_length_ + kMetalPage;
  reservation_ = ::mmap(nullptr, reservation_length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0);
  if (reservation_ == MAP_FAILED) {
    ::close(fd);
    reservation_ = nullptr;
    throw mtl::Error("[engine] cannot reserve " + std::to_string(reservation_length_) + " bytes to map " + path);
  }
  void* aligned = reinterpret_cast<void*>(round_up(reinterpret_cast<uintptr_t>(reservation_), kMetalPage));
  // Private and writable: nothing the engine does writes to weights, but a write (the Linux test runtime copies
  // every bound range back after a dispatch) must land in a private copy, never in the file.
  void* mapped = ::mmap(aligned, file_length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0);
  ::close(fd);
  if (mapped == MAP_FAILED) {
    ::munmap(reservation_, reservation_length_);
    reservation_ = nullptr;
    throw mtl::Error("[engine] cannot map " + path + ": " + std::strerror(errno));
  }
  data_ = mapped;
}

MappedFile::~MappedFile() {
  if (reservation_) ::munmap(reservation_, reservation_length_);
}

// ---- the engine ----

Engine::Engine(const ModelConfig& config, Precision precision, const Switches& switches, size_t max_context,
               const std::vector<KernelFamily>& kernel_families, const std::optional<MetallibFile>& metallib)
    : config_(config), precision_(precision), switches_(switches), max_context_(max_context) {
  config_.validate();
  config_.check_kernel_shapes();
  if (max_context_ == 0) throw mtl::Error("[engine] max_context must be positive");
  device_ = metallib ? std::make_unique<Device>(*metallib) : std::make_unique<Device>(kernel_families);
  switches_.tensor_ops = switches_.tensor_ops && device_->supports_tensor_ops();
  if (switches_.mma_attention && !simdgroup_layout_matches(*device_)) {
    std::fprintf(stderr, "lily: this GPU's simdgroup_matrix lane layout differs from the one attention_prefill_mma "
                         "assumes; prefill attention uses the vector kernel\n");
    switches_.mma_attention = false;
  }
}

Engine::~Engine() {
  // The command buffers and the buffers wrapping reserved memory go before the memory does.
  in_flight_.clear();
  programs_.clear();
  buffers_.clear();
  for (auto [address, length] : reservations_) ::munmap(address, length);
}

int Engine::add_file(const std::string& path) {
  files_.push_back(std::make_unique<MappedFile>(path));
  const MappedFile& file = *files_.back();
  int id = base_.add_buffer(path, file.mapped_length(), BufferRole::Weights);
  buffers_.push_back(device_->wrap_memory(file.data(), file.mapped_length()));
  return id;
}

int Engine::add_owned(const void* data, size_t length) {
  int id = base_.add_buffer("materialised weights", length, BufferRole::Weights);
  buffers_.push_back(device_->new_buffer(base_.buffers[id].length));
  if (length) std::memcpy(buffers_.back().contents(), data, length);
  owned_bytes_ += length;
  return id;
}

int Engine::add_reserved(size_t length) {
  // Address space only (MAP_NORESERVE, never written): a full-size model's synthetic weights cost no memory while
  // the kernels that would read them are stubbed out.
  const size_t mapped = round_up(std::max<size_t>(length, 1), kMetalPage);
  void* reservation = ::mmap(nullptr, mapped + kMetalPage, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANON | MAP_NORESERVE, -1, 0);
  if (reservation == MAP_FAILED) throw mtl::Error("[engine] cannot reserve " + std::to_string(mapped) + " bytes");
  reservations_.emplace_back(reservation, mapped + kMetalPage);
  void* aligned = reinterpret_cast<void*>(round_up(reinterpret_cast<uintptr_t>(reservation), kMetalPage));
  int id = base_.add_buffer("reserved weights", mapped, BufferRole::Weights);
  buffers_.push_back(device_->wrap_memory(aligned, mapped));
  return id;
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

void Engine::bind_weight(const std::string& name, const WeightRef& ref) {
  if (loaded_) throw mtl::Error("[engine] " + name + ": weights are bound before finish_loading");
  for (const Span* span : {&ref.data, &ref.scales, &ref.biases}) {
    if (span->length == 0 && span != &ref.data) continue;
    if (span->buffer < 0 || static_cast<size_t>(span->buffer) >= buffers_.size() ||
        span->offset + span->length > base_.buffers[span->buffer].length) {
      throw mtl::Error("[engine] " + name + ": its byte range is not inside a loaded file or buffer");
    }
  }
  if (ref.bits && ref.cols % 64) throw mtl::Error("[engine] " + name + ": input features must be a multiple of 64");
  weights_[name] = ref;
}

void Engine::finish_loading() {
  // Dense tensors are read by kernels templated on the activation dtype, except A_log and dt_bias (always f32).
  const DType act = precision_ == Precision::Float32 ? DType::F32 : DType::BF16;
  for (const auto& [name, w] : weights_) {
    if (w.bits) continue;
    DType wanted = ends_with(name, "A_log") || ends_with(name, "dt_bias") ? DType::F32 : act;
    if (w.dtype != wanted) {
      throw mtl::Error("[engine] " + name + " must be bound as " + dtype_name(wanted) + " for this precision; got " +
                       dtype_name(w.dtype));
    }
  }
  size_t first_new = base_.buffers.size();
  decode_ = add_decode_buffers(config_, precision_, std::min(max_context_, switches_.kv_growth_block()), max_context_,
                               base_);
  for (size_t i = first_new; i < base_.buffers.size(); ++i) buffers_.push_back(device_->new_buffer(base_.buffers[i].length));
  // A dry build names any missing tensor now rather than at the first token.
  Graph probe;
  probe.buffers = base_.buffers;
  build_decode_step(config_, precision_, switches_, weights_, decode_, 0, 0, 1, probe);
  // Every decode pipeline is built now: a kernel missing for this checkpoint's quantization is named at load, and
  // the first token does not pay for compilation.
  for (const Node& node : probe.nodes) device_->pipeline(node.kernel);
  loaded_ = true;
  reset();
}

void Engine::reset() {
  for (size_t i = 0; i < base_.buffers.size(); ++i) {
    if (base_.buffers[i].role == BufferRole::State || base_.buffers[i].role == BufferRole::Io) {
      std::memset(buffers_[i].contents(), 0, buffers_[i].length());
    }
  }
  position_ = 0;
}

void Engine::ensure_capacity(size_t keys) {
  if (keys > max_context_) {
    throw mtl::Error("[engine] the context limit is " + std::to_string(max_context_) + " tokens; this call needs " +
                     std::to_string(keys));
  }
  const size_t old_capacity = decode_.kv_capacity;
  if (keys <= old_capacity) return;
  const size_t capacity = std::min(round_up(keys, switches_.kv_growth_block()), max_context_);
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;  // one head
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    for (int id : {decode_.k_cache[layer], decode_.v_cache[layer]}) {
      if (id < 0) continue;
      Buffer grown = device_->new_buffer(config_.num_kv_heads * capacity * row);
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        std::memcpy(static_cast<char*>(grown.contents()) + h * capacity * row,
                    static_cast<const char*>(buffers_[id].contents()) + h * old_capacity * row, position_ * row);
      }
      buffers_[id] = std::move(grown);
      base_.buffers[id].length = buffers_[id].length();
    }
  }
  decode_.kv_capacity = capacity;
}


// ---- the decode step: built once per shape, re-encoded per token ----

size_t Engine::split_blocks(size_t position) const {
  const size_t split_min = switches_.split_kv_min_keys ? switches_.split_kv_min_keys : tuning::kAttentionSplitMinKeys;
  const size_t keys = position + 1;
  if (!switches_.split_kv || keys < split_min) return 0;
  return (keys + tuning::kAttentionSplitBlock - 1) / tuning::kAttentionSplitBlock;
}

// The step for this token slot, choice and shape (KV capacity, split-KV blocks at this position): found among the
// programs built so far, else built now. Nothing in it is looked up by name per token.
Engine::Program& Engine::program(int token_slot, const std::optional<TokenChoice>& choice) {
  const size_t blocks = split_blocks(position_);
  for (Program& p : programs_) {
    if (p.token_slot == token_slot && p.kv_capacity == decode_.kv_capacity && p.split_blocks == blocks &&
        p.choice == choice) {
      return p;
    }
  }
  auto graph = std::make_shared<Graph>();
  graph->buffers = base_.buffers;
  build_decode_step(config_, precision_, switches_, weights_, decode_, position_, token_slot, 1 - token_slot, *graph,
                    choice);
  Program built = build_program(std::move(graph));
  built.token_slot = token_slot;
  built.kv_capacity = decode_.kv_capacity;
  built.split_blocks = blocks;
  built.choice = choice;
  ++programs_built_;
  // A few shapes live at once (two token slots, with and without a choice); older shapes are not coming back.
  if (programs_.size() >= 8) programs_.erase(programs_.begin());
  programs_.push_back(std::move(built));
  return programs_.back();
}

Engine::Program Engine::build_program(std::shared_ptr<const Graph> graph) const {
  const std::vector<bool> starts = stage_starts(*graph);
  Program program;
  program.dispatches.reserve(graph->nodes.size());
  // What the dispatches before leave bound at each index (one compute encoder holds the whole step): a NodeArg.
  std::vector<const NodeArg*> bound;
  const Pipeline* previous = nullptr;
  for (size_t i = 0; i < graph->nodes.size(); ++i) {
    const Node& node = graph->nodes[i];
    const Pipeline* pipeline = &device_->pipeline(node.kernel);
    Program::Dispatch d{pipeline, {}, node.groups, node.threads, i > 0 && starts[i], node.per_position,
                        pipeline == previous, {}};
    previous = pipeline;
    if (bound.size() < node.args.size()) bound.resize(node.args.size(), nullptr);
    for (size_t k = 0; k < node.args.size(); ++k) {
      const NodeArg& a = node.args[k];
      d.args.push_back(a.buffer >= 0 ? Argument::buffer(buffer(a.buffer), a.offset)
                                     : Argument::bytes(a.bytes.data(), a.bytes.size()));
      const bool follows_position = std::any_of(node.per_position.begin(), node.per_position.end(),
                                                [&](const PositionField& f) { return f.arg == k; });
      const NodeArg* was = bound[k];
      const bool same = was != nullptr && !follows_position && was->buffer == a.buffer && was->offset == a.offset &&
                        was->bytes == a.bytes;
      d.rebind.push_back(!same);
      // A field that follows the position differs between tokens: nothing may count on it staying bound.
      bound[k] = follows_position ? nullptr : &a;
    }
    program.dispatches.push_back(std::move(d));
  }
  program.serial = std::all_of(starts.begin(), starts.end(), [](bool start) { return start; });
  program.graph = std::move(graph);
  return program;
}

// Rewrites the fields that follow the position, then encodes with the barriers placed when the step was built.
std::unique_ptr<Encoder> Engine::encode_program(Program& program, long dropped_barrier, bool dry) {
  // A dropped barrier (tests) needs the concurrent encoder whose barrier it drops.
  const bool serial = program.serial && dropped_barrier < 0;
  const BarrierPolicy policy = serial ? BarrierPolicy::Serial : BarrierPolicy::Manual;
  auto encoder = dry ? std::make_unique<Encoder>(*device_, policy, Encoder::Dry{})
                     : std::make_unique<Encoder>(*device_, policy);
  mtl::AutoreleasePool pool;
  for (size_t i = 0; i < program.dispatches.size(); ++i) {
    Program::Dispatch& d = program.dispatches[i];
    for (const PositionField& f : d.per_position) {
      d.args[f.arg].patch_u32(f.offset, static_cast<uint32_t>(static_cast<long>(position_) + f.delta));
    }
    if (!serial && d.barrier && static_cast<long>(i) != dropped_barrier) encoder->barrier();
    encoder->dispatch_planned(*d.pipeline, d.same_pipeline, d.args, d.rebind, d.groups, d.threads);
  }
  last_graph_ = program.graph;
  return encoder;
}

std::unique_ptr<Encoder> Engine::encode_nodes(const Graph& graph, const std::vector<bool>& starts, size_t begin,
                                              size_t end, long dropped_barrier) {
  const bool manual = dropped_barrier >= 0;
  auto encoder = std::make_unique<Encoder>(*device_, manual ? BarrierPolicy::Manual : BarrierPolicy::Automatic);
  auto ranges = [&](const std::vector<Span>& spans) {
    std::vector<BufferRange> out;
    for (const Span& s : spans) out.push_back({&buffer(s.buffer), s.offset, s.length});
    return out;
  };
  for (size_t i = begin; i < end; ++i) {
    const Node& node = graph.nodes[i];
    // Automatic: the Encoder places barriers from the ranges (serial mode adds one before every node). Manual:
    // the same places, computed here, with one left out.
    if (manual ? (i > begin && starts[i] && static_cast<long>(i) != dropped_barrier) : node.barrier_before) {
      encoder->barrier();
    }
    std::vector<Argument> args;
    for (const NodeArg& a : node.args) {
      args.push_back(a.buffer >= 0 ? Argument::buffer(buffer(a.buffer), a.offset)
                                   : Argument::bytes(a.bytes.data(), a.bytes.size()));
    }
    encoder->dispatch(device_->pipeline(node.kernel), args, node.groups, node.threads, ranges(node.reads),
                      ranges(node.writes));
  }
  return encoder;
}

void Engine::run_graph(Graph graph, long dropped_barrier) {
  const std::vector<bool> starts = stage_starts(graph);
  size_t begin = 0;
  for (const HostMoeSort& sort : graph.host_sorts) {
    std::unique_ptr<Encoder> encoder = encode_nodes(graph, starts, begin, sort.before_node, dropped_barrier);
    encoder->commit();
    encoder->wait();
    run_host_sort(sort);
    begin = sort.before_node;
  }
  std::unique_ptr<Encoder> encoder = encode_nodes(graph, starts, begin, graph.nodes.size(), dropped_barrier);
  encoder->commit();
  encoder->wait();
  last_graph_ = std::make_shared<const Graph>(std::move(graph));
}

void Engine::run_host_sort(const HostMoeSort& sort) {
  auto at = [&](const Span& span) {
    return reinterpret_cast<uint32_t*>(static_cast<unsigned char*>(buffers_[span.buffer].contents()) + span.offset);
  };
  host_moe_sort(sort, at(sort.expert_ids), at(sort.expert_offsets), at(sort.tile_map), at(sort.tile_count),
                at(sort.sorted_pairs));
}

void Engine::read_rows(int buffer_id, size_t rows, float* out) {
  const size_t n = rows * config_.vocab_size;
  const Buffer& logits = buffer(buffer_id);
  host_read_bytes_ += n * (precision_ == Precision::Float32 ? 4 : 2);
  if (precision_ == Precision::Float32) {
    std::memcpy(out, logits.contents(), n * 4);
    return;
  }
  const auto* bf16 = static_cast<const uint16_t*>(logits.contents());
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(bf16[i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

// The decode logits buffer from host logits (the last row of a prefill): f32, or bf16 (exact for logits that came
// from bf16, rounded to nearest even otherwise).
void Engine::write_logits(const float* logits) {
  void* out = buffers_[decode_.logits].contents();
  if (precision_ == Precision::Float32) {
    std::memcpy(out, logits, config_.vocab_size * 4);
    return;
  }
  auto* bf16 = static_cast<uint16_t*>(out);
  for (size_t i = 0; i < config_.vocab_size; ++i) {
    uint32_t bits;
    std::memcpy(&bits, logits + i, 4);
    bf16[i] = std::isnan(logits[i]) ? static_cast<uint16_t>((bits >> 16) | 0x40)
                                    : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
}

void Engine::ensure_prefill_rows(size_t rows) {
  if (has_prefill_ && prefill_.max_tokens >= rows) return;
  // The prefill scratch is the last group of buffers: a larger chunk replaces the group (same ids, new sizes).
  if (has_prefill_) {
    base_.buffers.erase(base_.buffers.begin() + static_cast<long>(prefill_first_buffer_), base_.buffers.end());
    buffers_.erase(buffers_.begin() + static_cast<long>(prefill_first_buffer_), buffers_.end());
  }
  prefill_first_buffer_ = base_.buffers.size();
  prefill_ = add_prefill_buffers(config_, precision_, rows, base_);
  if (!switches_.in_gemm_dequant) prefill_.dequant = add_dequant_scratch(precision_, weights_, base_);
  for (size_t i = prefill_first_buffer_; i < base_.buffers.size(); ++i) {
    buffers_.push_back(device_->new_buffer(base_.buffers[i].length));
  }
  has_prefill_ = true;
  programs_.clear();  // the decode steps hold the buffer list they were built over
}

void Engine::prefill_chunk(const uint32_t* tokens, size_t count, float* logits, size_t logit_rows,
                           long dropped_barrier) {
  const size_t chunk = switches_.prefill_chunk ? switches_.prefill_chunk : tuning::kPrefillChunk;
  ensure_prefill_rows(std::max(count, std::min(chunk, max_context_)));
  SharedExpertRouting routing = shared_expert_routing(count, switches_.wide_tiles);
  auto put = [&](int id, const void* data, size_t bytes) { std::memcpy(buffers_[id].contents(), data, bytes); };
  put(prefill_.ids, tokens, count * 4);
  put(prefill_.shared_pairs, routing.pairs.data(), routing.pairs.size() * 4);
  put(prefill_.ones, routing.ones.data(), routing.ones.size() * 4);
  put(prefill_.shared_tile_map, routing.tile_map.data(), routing.tile_map.size() * 4);
  put(prefill_.shared_tile_count, &routing.tile_count, 4);
  Graph graph;
  graph.buffers = base_.buffers;
  build_prefill_chunk(config_, precision_, switches_, weights_, decode_, prefill_, position_, count, logit_rows,
                      graph);
  run_graph(std::move(graph), dropped_barrier);
  if (logit_rows) read_rows(prefill_.logits, logit_rows, logits);
  position_ += count;
}

void Engine::require_idle(const char* what) const {
  if (!loaded_) throw mtl::Error(std::string("[engine] ") + what + " before finish_loading");
  if (decoding_) throw mtl::Error(std::string("[engine] ") + what + " while a decode is running (end_decode first)");
}

void Engine::forward(const std::vector<uint32_t>& tokens, float* logits, long dropped_barrier, bool last_only) {
  require_idle("forward");
  for (uint32_t token : tokens) {
    if (token >= config_.vocab_size) {
      throw mtl::Error("[engine] token id " + std::to_string(token) + " is not below vocab_size " +
                       std::to_string(config_.vocab_size));
    }
  }
  ensure_capacity(position_ + tokens.size());
  const size_t V = config_.vocab_size;
  if (switches_.batched_prefill && tokens.size() > 1) {
    const size_t chunk = !switches_.chunked_prefill ? tokens.size()
                         : std::min(switches_.prefill_chunk ? switches_.prefill_chunk : tuning::kPrefillChunk,
                                    max_context_);
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
    static_cast<uint32_t*>(buffers_[decode_.tokens].contents())[0] = tokens[t];
    std::unique_ptr<Encoder> encoder = encode_program(program(0, std::nullopt), dropped_barrier);
    encoder->commit();
    encoder->wait();
    ++position_;
    if (!last_only) {
      read_rows(decode_.logits, 1, logits + t * V);
    } else if (t + 1 == tokens.size()) {
      read_rows(decode_.logits, 1, logits);
    }
  }
}

// ---- decode on the GPU: the token chosen in the step, steps in flight ----

void Engine::begin_decode(const float* last_logits, const TokenChoice& choice) {
  require_idle("begin_decode");
  if (!switches_.gpu_token) throw mtl::Error("[engine] decoding on the GPU needs the GPU_TOKEN switch on");
  if (!(choice.temperature >= 0.0f) || !(choice.top_p > 0.0f && choice.top_p <= 1.0f) ||
      !(choice.min_p >= 0.0f && choice.min_p <= 1.0f)) {
    throw mtl::Error("[engine] token choice out of range: temperature >= 0, top_p in (0, 1], min_p in [0, 1]");
  }
  write_logits(last_logits);
  choice_ = choice;
  decoding_ = true;
  // The first token: the choice alone, over the uploaded logits, into slot 0 (a graph of one or two nodes).
  Graph graph;
  graph.buffers = base_.buffers;
  build_token_choice(config_, precision_, choice, decode_, position_, 0, 0, graph);
  std::unique_ptr<Encoder> encoder = encode_nodes(graph, stage_starts(graph), 0, graph.nodes.size(), -1);
  encoder->commit();
  in_flight_.push_back({std::move(encoder), 0});
  next_slot_ = 0;
}

void Engine::submit_step() {
  if (!decoding_) throw mtl::Error("[engine] submit_step before begin_decode");
  // Two slots: the step committed now overwrites the slot of the choice two back, which the host must have read.
  if (in_flight_.size() >= 2) throw std::logic_error("[engine] submit_step with two command buffers in flight");
  if (position_ + 1 > decode_.kv_capacity) {
    wait_in_flight();  // a growth re-allocates the caches the steps in flight use
    ensure_capacity(position_ + 1);
  }
  using Clock = std::chrono::steady_clock;
  auto ns = [](Clock::time_point a, Clock::time_point b) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  };
  if (host_timing_ && step_cpp_ns_.size() < kHostTimingSteps) {
    const auto start = Clock::now();
    encode_program(program(next_slot_, choice_), -1, /*dry=*/true);
    step_cpp_ns_.push_back(ns(start, Clock::now()));
  }
  const auto start = Clock::now();
  std::unique_ptr<Encoder> encoder = encode_program(program(next_slot_, choice_), -1);
  if (host_timing_ && step_encode_ns_.size() < kHostTimingSteps) step_encode_ns_.push_back(ns(start, Clock::now()));
  encoder->commit();
  in_flight_.push_back({std::move(encoder), 1 - next_slot_});
  next_slot_ = 1 - next_slot_;
  ++position_;
}

uint32_t Engine::next_token() {
  if (in_flight_.empty()) throw mtl::Error("[engine] next_token with nothing in flight (submit_step first)");
  InFlight done = std::move(in_flight_.front());
  in_flight_.pop_front();
  done.encoder->wait();
  host_read_bytes_ += 4;
  return static_cast<const uint32_t*>(buffer(decode_.tokens).contents())[done.slot];
}

void Engine::wait_in_flight() {
  for (InFlight& f : in_flight_) f.encoder->wait();
}

void Engine::end_decode() {
  wait_in_flight();
  in_flight_.clear();
  decoding_ = false;
}

void Engine::read_logits(float* out) {
  require_idle("read_logits");
  read_rows(decode_.logits, 1, out);
}

std::vector<uint32_t> Engine::generate_greedy(uint32_t first, size_t count) {
  if (first >= config_.vocab_size) throw mtl::Error("[engine] token id " + std::to_string(first) + " is out of range");
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
      for (int id : {decode_.conv_state[layer], decode_.recurrent_state[layer]}) {
        const auto* p = static_cast<const unsigned char*>(buffer(id).contents());
        out.insert(out.end(), p, p + base_.buffers[id].length);
      }
      continue;
    }
    for (int id : {decode_.k_cache[layer], decode_.v_cache[layer]}) {
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        const auto* p = static_cast<const unsigned char*>(buffer(id).contents()) + h * decode_.kv_capacity * row;
        out.insert(out.end(), p, p + position_ * row);
      }
    }
  }
  return out;
}

void Engine::restore(const unsigned char* snapshot, size_t length, size_t position) {
  if (length != snapshot_bytes(position)) {
    throw mtl::Error("[engine] snapshot of " + std::to_string(length) + " bytes does not match " +
                     std::to_string(position) + " tokens of this model's state");
  }
  position_ = 0;
  ensure_capacity(std::max<size_t>(position, 1));
  const size_t row = state_layout(config_, precision_).kv_bytes_per_row / config_.num_kv_heads;
  const unsigned char* p = snapshot;
  for (size_t layer = 0; layer < config_.num_layers(); ++layer) {
    if (!config_.attention_layers[layer]) {
      for (int id : {decode_.conv_state[layer], decode_.recurrent_state[layer]}) {
        std::memcpy(buffers_[id].contents(), p, base_.buffers[id].length);
        p += base_.buffers[id].length;
      }
      continue;
    }
    for (int id : {decode_.k_cache[layer], decode_.v_cache[layer]}) {
      for (size_t h = 0; h < config_.num_kv_heads; ++h) {
        std::memcpy(static_cast<unsigned char*>(buffers_[id].contents()) + h * decode_.kv_capacity * row, p,
                    position * row);
        p += position * row;
      }
    }
  }
  position_ = position;
}

}  // namespace lily
