// The model as the engine runs it: its configuration, where every weight lives (a byte range of a buffer), the
// state and scratch buffers, and the forward pass recorded as a graph of dispatches with declared read/write
// ranges. The graph is plain data: `lily plan` counts it without a GPU; `Engine` hands it to a Runtime (runtime.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime.h"
#include "types.h"

namespace lily {

enum class Precision { Float32, BFloat16 };

// The text configuration (ModelArgs of lily.config), as the graph needs it.
struct ModelConfig {
  size_t vocab_size = 0, hidden_size = 0;
  std::vector<bool> attention_layers;  // per layer: true = gated full attention, false = Gated DeltaNet
  size_t num_heads = 0, num_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  size_t gdn_k_heads = 0, gdn_v_heads = 0, gdn_k_dim = 0, gdn_v_dim = 0, conv_kernel = 0;
  size_t num_experts = 0, top_k = 0, expert_size = 0, shared_expert_size = 0;
  float eps = 1e-6f, rope_theta = 1e7f;
  size_t num_layers() const { return attention_layers.size(); }
  size_t conv_dim() const { return 2 * gdn_k_heads * gdn_k_dim + gdn_v_heads * gdn_v_dim; }
  // Throws Error naming the field when the shape is inconsistent (any graph, including `lily plan`).
  void validate() const;
  // Throws Error naming the field when the compiled kernels have no instance for this shape (running it).
  void check_kernel_shapes() const;
};

// Engine options: every optimization can be switched off (LILY_DISABLE_<FEATURE>) to check it changes nothing.
struct Switches {
  bool concurrent = true;          // CONCURRENT: off = a barrier after every dispatch (serial)
  bool fused_projections = true;   // FUSED_PROJECTIONS: off = one GEMV per projection matrix
  bool fusion = true;              // FUSION: off = decode RMSNorms, residual adds and routing as their own dispatches
  bool split_kv = true;            // SPLIT_KV: off = never the long-context split-KV attention path
  size_t split_kv_min_keys = 0;    // 0 = tuning::kAttentionSplitMinKeys (tests lower it to exercise the path)
  size_t split_kv_block_keys = 0;  // block count unit (tuning::attention_split_blocks); 0 = the runtime's choice:
                                   // tuning::kAttentionSplitShortBlockKeys where it prefers short blocks (CUDA), else
                                   // split_kv_min_keys
  bool split_prefill_kv = true;    // SPLIT_PREFILL_KV: off = prefill attention on matrix units always one pass over
                                   // the keys; on, a chunk of few query threadgroups at a long context splits them
                                   // (attention_prefill_mma_split + attention_decode_combine;
                                   // tuning::attention_prefill_split_blocks)
  size_t split_prefill_block_keys = 0;  // fewest keys per split prefill block; 0 = tuning's (tests lower it)
  bool gpu_token = true;           // GPU_TOKEN: off = the CPU reads logits and writes the next token itself
  bool batched_prefill = true;     // BATCHED_PREFILL: off = prompts run one decode step per token
  bool wide_tiles = true;          // WIDE_TILES: off = 16-row GEMM tiles only (qmm and the MoE grouped GEMMs)
  bool gpu_routing = true;         // GPU_ROUTING: off = prefill MoE pairs sorted on the CPU (a round trip per layer)
  bool chunked_prefill = true;     // CHUNKED_PREFILL: off = a prompt runs as one chunk, however long
  bool gqa_packing = true;         // GQA_PACKING: off = decode attention runs one query head per threadgroup
  bool register_scan = true;       // REGISTER_SCAN: off = the prefill DeltaNet state round-trips memory per block
  bool chunked_scan = true;        // CHUNKED_SCAN: off = the prefill DeltaNet scan walks every chunk token by token
  bool in_gemm_dequant = true;     // IN_GEMM_DEQUANT: off = prefill qmm as a dequantize pass + a dense GEMM
  bool coalesced_kv = true;        // COALESCED_KV: off = decode attention reads K/V rows with the plain lane mapping
  bool tensor_ops = true;          // TENSOR_OPS: prefill GEMMs on Metal 4 tensor ops (qmm_nax) where the GPU has them
  bool mma_attention = true;       // MMA_ATTENTION: off = prefill attention and the bf16 split-KV decode partials on
                                   // vector ALUs only (also forced off when the simdgroup_matrix lane-layout probe
                                   // disagrees on this GPU)
  bool replayed_prompts = true;    // REPLAYED_PROMPTS: off = a prompt chunk of 2 to tuning::kReplayedPromptMaxRows
                                   // tokens is built and launched node by node on every call, as longer chunks are
  bool staged_gemv = true;         // STAGED_GEMV: off = decode GEMVs read x from device memory per simdgroup (on only
                                   // where the runtime prefers staging x in threadgroup memory: CUDA)
  bool spread_deltanet_step = true;  // SPREAD_DELTANET_STEP: off = a decode token's DeltaNet core is one
                                    // gated_delta_step (a threadgroup per key head); on (with STAGED_GEMV: CUDA), the
                                    // conv runs in the in_proj GEMV, the recurrence over (value head, 32 rows)
                                    // threadgroups and the gated norm in the out_proj GEMV (tuning::spread_deltanet_step)
  bool whole_pack_loads = true;    // WHOLE_PACK_LOADS: off = the staged kernels (STAGED_GEMV: CUDA) read codes a word
                                   // at a time; on, a pack of 4 words as one 16-byte load where the codes lie on 16
                                   // bytes (tuning::whole_pack_loads)
  bool fused_attention_prep = true;  // FUSED_ATTENTION_PREP: off = split-KV decode attention on matrix units
                                     // (MMA_ATTENTION, bf16) runs after its own attention_prep dispatch; on, each
                                     // partial threadgroup preps its rows itself (attention_decode_partial_prep_mma)
  bool early_moe_down = true;      // EARLY_MOE_DOWN: off = the staged expert down kernel (STAGED_GEMV: CUDA) waits for
                                   // the gate/up kernel before it loads anything; on, it routes again from the
                                   // router's logits and loads its first weights and residual before that wait
  bool fused_argmax = true;        // FUSED_ARGMAX: off = a greedy decode step reduces its logits with argmax_partial
                                   // after the lm_head; on, the lm_head GEMV keeps each threadgroup's best logit
                                   // where it streams (staged: CUDA; qmv_norm_argmax_staged) and only argmax_final
                                   // runs after it
  bool mma_gemv = true;            // MMA_GEMV: off = 1 to 8 rows of bf16 activations run the vector GEMV (qmv) or the
                                   // 16-row GEMM tile (qmm); on (where the runtime prefers it, CUDA, and the
                                   // simdgroup_matrix lane layout is the one assumed), 4-bit weights with bf16 scales
                                   // run qmv_mma on matrix units at 2 to 8 rows, and at one from 8192 outputs on
                                   // (tuning::mma_gemv)
  bool split_steps = true;         // SPLIT_STEPS: off = a staged residual or segmented GEMV (STAGED_GEMV: CUDA) runs
                                   // each row's K steps one after another in one simdgroup; on, in 2-D threadgroups
                                   // whose rows of simdgroups take interleaved steps (tuning::qmv_step_slots)
  size_t prefill_chunk = 0;        // rows per prefill chunk; 0 = tuning::kPrefillChunk (tests lower it)
  size_t seg_stream_groups = 0;    // most threadgroups of the staged segmented GEMV (q|k|v, router; not the conv
                                   // one), which then streams its row blocks over them; 0 = one per block
  size_t kv_block = 0;             // KV cache growth step in rows; 0 = tuning::kKvCacheBlock (tests lower it)
  size_t kv_growth_block() const;
};

// A byte range of a graph buffer.
struct Span {
  int buffer = -1;
  size_t offset = 0;
  size_t length = 0;
};

enum class DType { F32, BF16, F16, U32 };
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // kernel-name suffix: f32, bf16, f16

// One weight: dense (bits == 0: `data` of `dtype`) or MLX affine-quantized (codes in `data`, scales and biases of
// `scale_dtype`, group 64 along the input axis). Shape [experts?, rows, cols] with cols the input features.
struct WeightRef {
  Span data, scales, biases;
  int bits = 0;
  DType dtype = DType::F32;
  DType scale_dtype = DType::BF16;
  size_t experts = 0, rows = 0, cols = 0;
  size_t bytes() const { return data.length + scales.length + biases.length; }
};

enum class BufferRole { Weights, State, Scratch, Io };

struct GraphBuffer {
  std::string name;
  size_t length = 0;
  BufferRole role = BufferRole::Scratch;
};

// One kernel argument at [[buffer(i)]]: a buffer from an offset, or bytes (setBytes).
struct NodeArg {
  int buffer = -1;
  size_t offset = 0;
  std::vector<unsigned char> bytes;
};

// A u32 field of a node's argument bytes that follows the decode position: bytes[offset..+4] of args[arg] hold
// position + delta. A decode step built once is re-encoded per token by rewriting these fields only.
struct PositionField {
  uint32_t arg = 0, offset = 0;
  int32_t delta = 0;
};

// One dispatch. `reads`/`writes` decide the barriers; `traffic_*` are the bytes it moves (equal to the declared
// ranges except where a kernel reads a data-dependent part of a range, e.g. 8 of 256 experts).
struct Node {
  std::string kernel;
  std::string label;  // what it computes, for `lily plan --json` and errors
  std::vector<NodeArg> args;
  Dim3 groups, threads;
  std::vector<Span> reads, writes;
  uint64_t traffic_read = 0, traffic_written = 0;
  bool barrier_before = false;  // forced (serial mode)
  std::vector<PositionField> per_position;  // decode: the fields that change from token to token
  // What the kernel reads before lily::grid_dependency_wait (a LILY_INSTANTIATE_EARLY_KERNEL: metal/lily.h), a part
  // of `reads`. A runtime may start such a node while the one node it depends on still runs (CUDA's programmatic
  // edges) only if that node writes none of these.
  std::vector<Span> early_reads;
};

// A step the CPU runs inside a forward pass (the GPU_ROUTING switch off): the nodes before `before_node` are
// committed and waited on, then the CPU reads the expert ids of `pairs` (token, slot) pairs and writes what the
// grouped GEMMs read, exactly as moe_sort_count/scan/scatter would: the pairs sorted by expert (stable), the
// expert offsets [E + 1], the tile map [tiles, 4] = (expert, first sorted row, rows, 0) and the tile count.
struct HostMoeSort {
  size_t before_node = 0;
  Span expert_ids, expert_offsets, tile_map, tile_count, sorted_pairs;
  size_t pairs = 0, experts = 0, tile_rows = 0, max_tiles = 0;
};

// The buffers a forward pass uses, its dispatches in order, and the CPU steps between them (none by default).
struct Graph {
  std::vector<GraphBuffer> buffers;
  std::vector<Node> nodes;
  std::vector<HostMoeSort> host_sorts;  // ascending before_node
  int add_buffer(const std::string& name, size_t length, BufferRole role);
};

// Runs a HostMoeSort on CPU-visible memory: `ids` in, the other four tables out. Throws Error on an expert id out
// of range (the GPU's routing output is checked before it indexes anything).
void host_moe_sort(const HostMoeSort& sort, const uint32_t* ids, uint32_t* expert_offsets, uint32_t* tile_map,
                   uint32_t* tile_count, uint32_t* sorted_pairs);

// Weights by canonical name (lily.checkpoint).
using WeightTable = std::map<std::string, WeightRef>;

// ---- the model (models/qwen3_5_moe.cpp): its tensors, its buffers and its forward pass, written once ----

// A weight table for a configuration with no checkpoint behind it (`lily plan --full-size`): every tensor laid
// out in one virtual buffer as an MLX 4-bit checkpoint stores it (routers 8-bit, norms and conv bf16, A_log and
// dt_bias f32). Returns the table and adds the buffer to `graph`.
WeightTable synthetic_weights(const ModelConfig& config, Graph& graph);

// Sizes of the engine's state: conv state [K-1, C] (activation dtype), recurrent state [Hv, dv, Dk] fp32, KV cache
// [Hkv, capacity, D] per attention layer (bf16, f32 in float32 mode).
struct StateLayout {
  size_t conv_bytes = 0, recurrent_bytes = 0, kv_bytes_per_row = 0;  // per layer; kv per cache row, K and V each
};
StateLayout state_layout(const ModelConfig& config, Precision precision);

// What a sequence keeps between forward passes (buffer ids): per layer the conv and recurrent state or the K/V caches
// (-1 where the layer has none), and what the GPU's token choice reads and writes: two token slots (alternating), the
// host-written logit bias and seen-token tables, the counts count_token keeps, the penalized logits and the choice's
// scratch (argmax partials, or the sampling block path's candidates and block statistics).
struct StateBuffers {
  std::vector<int> conv_state, recurrent_state, k_cache, v_cache;
  size_t kv_capacity = 0;
  int tokens, logit_bias, seen_tokens, token_counts, penalized_logits, choice_values, choice_ids;
};
StateBuffers add_state_buffers(const ModelConfig& config, Precision precision, size_t kv_capacity, Graph& graph);

// The scratch of forward passes of up to `rows` tokens, with logits (f32) for up to `logit_rows` of them (buffer
// ids, named "<name> <what it holds>"). Any row count up to `rows` finds what its kernels need: the one-row (decode)
// kernels' and the T-row kernels'. Projections of one input share a buffer, each matrix's T output rows a block after
// the previous matrix's (for one row: one concatenated row, what a segmented GEMV writes); likewise the router's T x E
// logits, then the T shared-expert gate logits. The shared-expert routing tables (shared_pairs, ones,
// shared_tile_map, shared_tile_count) are host-written: see shared_expert_routing.
struct PassBuffers {
  size_t rows = 0, logit_rows = 0;
  int ids, hidden, normed, mixer_out, projections, conv_out, core_out, gdn_out, q, gate, attn_out, attn_partial_out,
      attn_partial_stats, router, expert_ids, expert_weights, block_counts, expert_offsets, tile_map, tile_count,
      sorted_pairs, moe_hidden, expert_out, shared_pairs, shared_tile_map, shared_tile_count, ones, shared_hidden,
      shared_out, logits;
  int gdn_gate = -1;    // SiLU(z) of one row, f32 (the spread DeltaNet decode step: tuning::spread_deltanet_step)
  int dequant = -1;     // dense copy of one weight (IN_GEMM_DEQUANT off only): see add_dequant_scratch
  int gdn_chunks = -1;  // the chunked DeltaNet scan's operands (CHUNKED_SCAN on only): see add_gdn_chunk_scratch
};
// `max_keys` sizes the split-KV partials (the context limit).
PassBuffers add_pass_buffers(const ModelConfig& config, Precision precision, size_t rows, size_t logit_rows,
                             size_t max_keys, const std::string& name, Graph& graph);
// IN_GEMM_DEQUANT off: the buffer T-row GEMMs dequantize into, sized by the largest non-expert quantized weight.
int add_dequant_scratch(Precision precision, const WeightTable& weights, Graph& graph);
// CHUNKED_SCAN on: the chunked DeltaNet scan's fp32 operands for passes of up to `rows` rows; -1 (no buffer) when no
// pass that long takes the chunked scan (ops::gated_delta_chunk_scratch_bytes).
int add_gdn_chunk_scratch(const ModelConfig& config, size_t rows, Graph& graph);

// The shared expert's static routing for `tokens` rows: (pairs, ones, tile map, tile count) as the host writes them.
struct SharedExpertRouting {
  std::vector<uint32_t> pairs, tile_map;
  std::vector<float> ones;
  uint32_t tile_count = 0;
};
SharedExpertRouting shared_expert_routing(size_t tokens, bool wide_tiles);

// Bytes held in a runtime's memory, by what they hold: weights (files, copies, realigned tensors), the KV cache (at
// its capacity), the other per-sequence state (DeltaNet and conv states) and scratch (activations, the prefill
// chunk's buffers, logits, token ids); `peak` is the engine's to keep.
struct DeviceMemory {
  uint64_t weights = 0, kv_cache = 0, state = 0, scratch = 0, peak = 0;
  uint64_t total() const { return weights + kv_cache + state + scratch; }
  // Counts buffer `id` of `bytes` and `role`; the decode's K and V caches count apart from the other state.
  void add(const StateBuffers& held, int id, BufferRole role, uint64_t bytes);
};

// How a decode step chooses its next token on the GPU (lily.sampling steps 1-6): temperature 0 is greedy (argmax),
// otherwise sample_* with top-k, top-p, min-p and a Philox draw keyed by `seed`, counter = the chosen token's position.
// With a logit bias or a penalty, penalize_logits runs first (steps 1-3) and count_token records each chosen token.
struct TokenChoice {
  float temperature = 0.0f;
  uint32_t top_k = 0;
  float top_p = 1.0f, min_p = 0.0f;
  uint64_t seed = 0;
  float repetition_penalty = 1.0f, presence_penalty = 0.0f, frequency_penalty = 0.0f;
  bool logit_bias = false;  // the bias buffer holds the request's logit_bias (uploaded by begin_decode)
  bool penalized() const {
    return logit_bias || repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
  bool operator==(const TokenChoice& o) const {
    return temperature == o.temperature && top_k == o.top_k && top_p == o.top_p && min_p == o.min_p &&
           seed == o.seed && repetition_penalty == o.repetition_penalty && presence_penalty == o.presence_penalty &&
           frequency_penalty == o.frequency_penalty && logit_bias == o.logit_bias;
  }
};

// What a penalized choice starts from (Engine::begin_decode): the request's logit bias (ids and values) and the token
// history the repetition penalty sees (the session's tokens before this decode).
struct PenaltyInputs {
  std::vector<uint32_t> bias_ids;
  std::vector<float> bias_values;
  std::vector<uint32_t> context;
};

// One forward pass: `tokens` token ids from ids[ids_offset ..] at `position` (the state holds the tokens before it)
// through every layer, then the final norm and lm_head for the last `logit_rows` rows (0: none) into pass.logits.
// Each op picks its kernels by the row count: one row runs the decode kernels, with the RMSNorms, residual adds and
// routing folded into the GEMVs next to them (switches.fusion) and each input's projections as one segmented GEMV
// (switches.fused_projections); more rows run the T-row kernels (ops::qmatmul: qmv up to its row limit, then qmm).
// Per-token argument fields are PositionFields (the engine builds a one-row pass once and re-encodes it per token).
struct PassInput {
  size_t position = 0, tokens = 1, logit_rows = 1;
  Span ids;
  size_t ids_offset = 0;
  // Set (a greedy decode step with FUSED_ARGMAX): where the one-row lm_head may write its threadgroups' best logits.
  Span argmax_values, argmax_ids;
};
// Returns the argmax partials the lm_head wrote to input.argmax_values / argmax_ids (0: none; the logits alone).
size_t build_forward(const ModelConfig& config, Precision precision, const Switches& switches,
                   const WeightTable& weights, const StateBuffers& state, const PassBuffers& pass,
                   const PassInput& input, Graph& graph);

// The dispatches that choose a token from the f32 `logits` (one row) into tokens[out_slot]: argmax or sample (see
// TokenChoice); the token chosen sits at `position` (the sampler's counter, a PositionField of delta
// `position_delta`). `argmax_partials` > 0: the lm_head already wrote that many argmax partials to the state's
// choice buffers (build_forward's result), so a greedy choice is argmax_final alone.
void build_token_choice(const ModelConfig& config, const TokenChoice& choice, const StateBuffers& state,
                        const Span& logits, size_t position, int position_delta, int out_slot, Graph& graph,
                        size_t argmax_partials = 0);

// One decode step at `position`: the one-row pass of tokens[token_slot] with its logits, then (switches.gpu_token and
// a `choice`) the token choice into tokens[next_slot].
void build_decode_step(const ModelConfig& config, Precision precision, const Switches& switches,
                       const WeightTable& weights, const StateBuffers& state, const PassBuffers& step,
                       size_t position, int token_slot, int next_slot, Graph& graph,
                       const std::optional<TokenChoice>& choice = TokenChoice{});

// The kernels the decode steps (greedy and sampled, first position and `max(prefill_rows)`) and the passes of
// `prefill_rows` tokens dispatch for this configuration, with every quantized weight at `bits` (0: as MLX stores the
// model, 8-bit routers and 4-bit others) and scales and biases in `scale_dtype` (graph_kernels.cpp; the registry
// test's engine paths).
std::vector<std::string> graph_kernels(const ModelConfig& config, Precision precision, const Switches& switches,
                                       int bits, DType scale_dtype, const std::vector<size_t>& prefill_rows);

// The engine: weights bound to checkpoint files (or materialised once), state buffers, the prefill chunk graph and
// the decode step, built once per shape and recorded once, then submitted per token, all through a Runtime (Metal or
// CUDA). Not thread-safe.
class Engine {
 public:
  Engine(const ModelConfig& config, Precision precision, const Switches& switches, size_t max_context,
         std::unique_ptr<Runtime> runtime);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Loading. Graph-buffer ids name where a weight's bytes are: a mapped file or a materialised (owned) copy.
  int add_file(const std::string& path);
  int add_owned(const void* data, size_t length);
  // `length` bytes of address space that are never touched (host-cost runs: synthetic weights, kernels stubbed).
  int add_reserved(size_t length);
  // Where byte 0 of buffer `id` (a file) lies in it: non-zero where the runtime shifted the file to align its tensors.
  size_t buffer_origin(int id) const;
  // Bytes copied into engine-owned weight buffers so far (everything not bound as a range of a mapped file).
  size_t owned_bytes() const { return owned_bytes_; }
  void bind_weight(const std::string& name, const WeightRef& ref);
  // Binds every tensor to reserved, never-touched memory laid out as `synthetic_weights` (host-cost runs only:
  // `lily bench --full-size --host-only`, with kernel execution stubbed out).
  void bind_synthetic_weights();
  // Checks every tensor the graph needs is bound (copying nothing), allocates the state.
  void finish_loading();

  // State: one live sequence. `reset` empties it; `snapshot` copies the conv and recurrent state and the KV prefix
  // in use; `restore` puts a snapshot back.
  void reset();
  size_t position() const { return position_; }
  std::vector<unsigned char> snapshot() const;
  void restore(const unsigned char* snapshot, size_t length, size_t position);
  size_t snapshot_bytes(size_t position) const;

  // Runs `tokens`; writes logits [T, V] (fp32), or only the last row [1, V] with `last_only` (prefill computes
  // lm_head for that row alone). `dropped_barrier` >= 0 leaves out the barrier in front of that node of each step
  // (tests: a missing barrier must break the result).
  void forward(const std::vector<uint32_t>& tokens, float* logits, long dropped_barrier = -1, bool last_only = false);

  // Decoding with the token chosen on the GPU, steps in flight (docs/engine.md, "Decode on the GPU").
  // begin_decode uploads the logits of the last position and commits the choice of the first token; each
  // submit_step commits one decode step (the token in the slot the previous choice wrote -> the next token into the
  // other slot) without waiting; next_token waits for the oldest choice in flight and returns its token. At most
  // two command buffers are in flight. end_decode waits for everything in flight: the state then holds every
  // token submitted, and the logits buffer the last step's logits (read_logits).
  // A penalized choice (choice.penalized()) also takes `penalties`: the bias and seen-token tables are written from
  // them, and the token counts start at zero.
  void begin_decode(const float* last_logits, const TokenChoice& choice, const PenaltyInputs& penalties = {});
  void submit_step();
  uint32_t next_token();
  void end_decode();
  size_t steps_in_flight() const { return in_flight_.size(); }
  // The logits [1, V] of the last decode step (after end_decode).
  void read_logits(float* out);
  // Greedy continuation on the GPU (tests): `count` tokens after `first`, through the steps-in-flight path.
  std::vector<uint32_t> generate_greedy(uint32_t first, size_t count);

  // Bytes copied from engine buffers to the host so far: logits rows and token ids.
  uint64_t host_read_bytes() const { return host_read_bytes_; }
  // Host-cost runs. step_encode_ns (`encode` on): finding the recorded step and submitting it (Metal: patching,
  // encoding and committing it). step_cpp_ns (`cpp` on): each step is also submitted dry (Runtime::submit_dry: no
  // driver call), timed: the engine's own C++. The dry submission costs the host time and cache, so a run that
  // measures the whole token leaves `cpp` off. At most kHostTimingSteps entries each.
  static constexpr size_t kHostTimingSteps = 1 << 16;
  void set_host_timing(bool encode, bool cpp) { time_encode_ = encode, time_cpp_ = cpp; }
  const std::vector<uint64_t>& step_encode_ns() const { return step_encode_ns_; }
  const std::vector<uint64_t>& step_cpp_ns() const { return step_cpp_ns_; }
  void reset_host_timing() { step_encode_ns_.clear(), step_cpp_ns_.clear(); }
  // Decode programs built so far (a step is built once per shape, not once per token).
  size_t programs_built() const { return programs_built_; }
  // Split-KV blocks of the decode step at `position` (0: the single pass), by this engine's switches and runtime.
  size_t split_blocks(size_t position) const;
  // Bytes the engine holds in the runtime's memory (reserved address space holds nothing); `peak`: the most held at
  // once since loading began (a KV-cache growth holds the old and the new layer a moment).
  DeviceMemory device_memory() const;
  // The last command buffer's graph.
  const Graph& last_graph() const { return *last_graph_; }
  // Per-node device times of prefill chunks (lily bench --profile): while on, each chunk's graph runs node by node
  // (Runtime RecordOptions::profiled) and its nodes' times are appended to node_times() in run order. Throws Error
  // when the runtime does not report them.
  struct NodeTime {
    std::string kernel, label;
    double milliseconds;
  };
  void set_profiling(bool on);
  bool supports_profiling() const { return runtime_->supports_profiling(); }
  const std::vector<NodeTime>& node_times() const { return node_times_; }
  void clear_node_times() { node_times_.clear(); }
  const ModelConfig& config() const { return config_; }
  Runtime& runtime() const { return *runtime_; }

 private:
  // A pass built once per shape and recorded once for the runtime, submitted with the position written into its
  // per-position fields: a decode step (one row: token slot, choice, KV capacity, split-KV blocks at this position),
  // or a short prompt's pass (rows, logit rows, KV capacity; REPLAYED_PROMPTS).
  struct Program {
    size_t rows = 1, logit_rows = 1;
    int token_slot = 0;
    size_t kv_capacity = 0, split_blocks = 0;
    std::optional<TokenChoice> choice;
    std::shared_ptr<const Graph> graph;
    std::shared_ptr<RecordedGraph> recorded;
  };
  struct InFlight {
    std::unique_ptr<Submission> work;
    int slot;  // the token slot its choice writes
  };

  void ensure_capacity(size_t keys);
  void prefill_chunk(const uint32_t* tokens, size_t count, float* logits, size_t logit_rows, long dropped_barrier);
  Program& program(int token_slot, const std::optional<TokenChoice>& choice);
  Program& short_pass(size_t rows, size_t logit_rows);
  Program& keep(Program built);
  std::unique_ptr<Submission> submit_program(const Program& program, long dropped_barrier);
  // Submits `graph` and waits, running its host steps in between (one submission per segment).
  void run_graph(Graph graph, long dropped_barrier);
  int add_buffer(const std::string& name, BufferRole role, std::unique_ptr<DeviceBuffer> buffer);
  // Raises the peak to what is held now plus `transient` bytes about to be let go.
  void note_memory(uint64_t transient = 0);
  std::unique_ptr<DeviceBuffer> allocate(const GraphBuffer& buffer) const;
  std::vector<DeviceBuffer*> buffer_list() const;
  void run_host_sort(const HostMoeSort& sort);
  void ensure_chunk_rows(size_t rows, size_t logit_rows);
  PassInput chunk_input(size_t rows, size_t logit_rows) const;
  void read_rows(int buffer_id, size_t rows, float* out);
  void write_logits(const float* logits);
  void write_penalty_tables(const TokenChoice& choice, const PenaltyInputs& penalties);
  void wait_in_flight();
  void require_idle(const char* what) const;

  ModelConfig config_;
  Precision precision_;
  Switches switches_;
  size_t max_context_;
  std::unique_ptr<Runtime> runtime_;
  Graph base_;                                         // buffers only
  std::vector<std::unique_ptr<DeviceBuffer>> buffers_;  // one per graph buffer
  WeightTable weights_;
  StateBuffers state_{};
  PassBuffers step_{};   // the decode step's scratch (one row)
  PassBuffers chunk_{};  // the prefill chunks' scratch (allocated at the first chunk, grown with longer ones)
  bool has_chunk_ = false;
  size_t chunk_first_buffer_ = 0;  // the chunk scratch buffers are the last ones, from this id on
  bool loaded_ = false;
  size_t position_ = 0;
  size_t owned_bytes_ = 0;
  std::vector<int> reserved_buffers_;  // address space only (synthetic weights): no memory held
  uint64_t peak_bytes_ = 0;
  std::vector<Program> programs_;  // the decode steps built so far (a few shapes)
  size_t programs_built_ = 0;
  std::deque<InFlight> in_flight_;
  bool decoding_ = false;
  TokenChoice choice_{};
  int next_slot_ = 0;  // the token slot the next decode step reads
  uint64_t host_read_bytes_ = 0;
  bool time_encode_ = false, time_cpp_ = false;
  bool profiling_ = false;
  std::vector<NodeTime> node_times_;
  std::vector<uint64_t> step_encode_ns_, step_cpp_ns_;
  std::shared_ptr<const Graph> last_graph_ = std::make_shared<const Graph>();
};

}  // namespace lily
