"""The `metal` backend end to end through the Linux test runtime (fake Metal running the real kernels on the CPU
harness), against lily.reference on tiny random checkpoints with the model's head shapes (attention head dim 256,
DeltaNet dk = dv = 128: the shapes the kernels are built for), in the MLX 4-bit and the HF (quantized on load)
layouts (bf16 and f32 HF files quantized on load), float32 mode, and the bfloat16 (default) mode."""

from __future__ import annotations

import copy
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import lily.checkpoint
from lily._ext import _test_engine as te
from lily.checkpoint import load_checkpoint
from lily.backends.metal import MetalBackend
from lily.reference import ReferenceModel

from tests.engine.runtimes import real_driver
from tests.fixtures import _KV64, build_hf_model, save_hf_checkpoint, save_mlx_checkpoint

# Each test that takes `engine_backend` runs on both runtimes of the engine (tests/engine/conftest.py).

# The model's per-head shapes at a tiny width: 3 DeltaNet layers and 1 attention layer, 8 experts top-2.
HEAD_SHAPES_CONFIG = copy.deepcopy(_KV64)
HEAD_SHAPES_CONFIG.update(
    vocab_size=640, hidden_size=128, head_dim=256, num_attention_heads=4, num_key_value_heads=1,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
    moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
)
# 9 tokens: one prefill chunk takes the matrix-unit attention path (>= 8 queries); chunks of 4 take the vector path.
PROMPT = np.array([5, 17, 300, 2, 639, 0, 77, 123, 64])
GREEDY_TOKENS = 32
# Every switch off at once (split_kv_min_keys = 1 forces the long-context path instead of turning it off).
ALL_FLIPPED = {"concurrent": False, "fused_projections": False, "split_kv_min_keys": 1, "gpu_token": False,
               "batched_prefill": False}


def save_checkpoints(root: Path) -> None:
    """The three layouts of the head-shapes model under `root` (scripts/h200_engine_check.sh makes them here for a
    GPU machine without mlx-lm, which reads them from $LILY_ENGINE_CHECKPOINTS)."""
    model = build_hf_model(HEAD_SHAPES_CONFIG, seed=3)
    hf = save_hf_checkpoint(model, root / "hf", dtype="bfloat16")
    save_mlx_checkpoint(hf, root / "mlx")
    save_hf_checkpoint(model, root / "hf32", dtype="float32")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    prepared = os.environ.get("LILY_ENGINE_CHECKPOINTS")
    root = Path(prepared) if prepared else tmp_path_factory.mktemp("head_shapes")
    if not prepared:
        save_checkpoints(root)
    # hf32: quantized on load with f32 scales, so the "_sf32" kernel variants run.
    return {"mlx": load_checkpoint(root / "mlx"), "hf": load_checkpoint(root / "hf", quantize=4),
            "hf32": load_checkpoint(root / "hf32", quantize=4)}


@pytest.fixture(scope="module")
def reference_run(checkpoints):
    """Reference logits of the prompt and its greedy continuation, per layout."""
    out = {}
    for layout, checkpoint in checkpoints.items():
        ref = ReferenceModel(checkpoint)
        state = ref.new_state()
        logits = ref.forward(PROMPT, state)
        tokens = [int(np.argmax(logits[-1]))]
        for _ in range(GREEDY_TOKENS - 1):
            tokens.append(int(np.argmax(ref.forward(np.array([tokens[-1]]), state)[-1])))
        out[layout] = (logits, tokens)
    return out


@pytest.fixture(autouse=True)
def reverse_order():
    if not hasattr(te, "set_stage_order"):  # a real GPU: its own dispatch order
        yield
        return
    te.set_stage_order("reverse")  # dispatches of a stage run in reverse: a missing barrier shows
    yield
    te.set_stage_order("reverse")


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("layout", ["mlx", "hf", "hf32"])
def test_logits_and_greedy_tokens_match_the_reference(engine_backend, checkpoints, reference_run, layout):
    backend = engine_backend(checkpoints[layout], precision="float32")
    want_logits, want_tokens = reference_run[layout]
    state = backend.new_state()
    logits = backend.forward(PROMPT, state)
    assert logits.shape == want_logits.shape and state.position == len(PROMPT)
    assert relative_error(logits, want_logits) < 1e-3
    first = int(np.argmax(logits[-1]))
    assert first == want_tokens[0]
    # The GPU chooses every next token; step k+1 is committed before step k is waited on.
    assert [first] + backend.generate_greedy(state, first, GREEDY_TOKENS - 1) == want_tokens
    assert state.position == len(PROMPT) + GREEDY_TOKENS - 1


def test_every_switch_flipped_gives_the_same_tokens(engine_backend, checkpoints, reference_run):
    backend = engine_backend(checkpoints["mlx"], precision="float32", switches=ALL_FLIPPED)
    want_logits, want_tokens = reference_run["mlx"]
    state = backend.new_state()
    logits = backend.forward(PROMPT, state)
    assert relative_error(logits, want_logits) < 1e-3
    counts = backend.last_step_counts()
    assert counts["stages"] == counts["dispatches"]  # serial
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(GREEDY_TOKENS - 1):  # the CPU chooses (no GPU token)
        tokens.append(int(np.argmax(backend.forward(np.array([tokens[-1]]), state)[-1])))
    assert tokens == want_tokens


@pytest.mark.parametrize("switch", [{"concurrent": False}, {"fused_projections": False},
                                    {"split_kv_min_keys": 1}, {"split_kv_min_keys": 8, "split_kv_block_keys": 1},
                                    {"split_kv": False}, {"gpu_token": False},
                                    {"batched_prefill": False}, {"prefill_chunk": 4}, {"gpu_routing": False},
                                    {"prefill_chunk": 4, "chunked_prefill": False},
                                    {"seg_stream_groups": 1}, {"seg_stream_groups": 3}])
def test_each_switch_gives_the_same_logits(engine_backend, checkpoints, switch):
    default = engine_backend(checkpoints["mlx"], precision="float32")
    flipped = engine_backend(checkpoints["mlx"], precision="float32", switches=switch)
    want_state, got_state = default.new_state(), flipped.new_state()
    want = default.forward(PROMPT, want_state)
    got = flipped.forward(PROMPT, got_state)
    # A decode step after the prompt (the decode graph under the same switch).
    want = np.concatenate([want, default.forward(PROMPT[:1], want_state)])
    got = np.concatenate([got, flipped.forward(PROMPT[:1], got_state)])
    # Other kernels or chunkings of the same maths (prefill vs decode kernels, split-KV merging per-block sums).
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


def test_split_kv_block_counts_change_over_a_decode(engine_backend, checkpoints):
    """split_kv_min_keys = 2 scales the split-KV rule (tuning::attention_split_blocks: 2 blocks at the threshold,
    doubling with the keys) down to the fixture: the decode steps at 10 .. 40 keys run 8, 16 and 32 blocks, with
    spans ceil(keys / blocks) that leave short and empty last blocks. Every step agrees with split-KV off, and the
    decode program is rebuilt only when the block count changes (one recorded program serves its whole bucket)."""
    checkpoint = checkpoints["mlx"]
    plain = engine_backend(checkpoint, precision="float32", switches={"split_kv": False})
    split = engine_backend(checkpoint, precision="float32", switches={"split_kv_min_keys": 2})
    want_state, got_state = plain.new_state(), split.new_state()
    want, got = [plain.forward(PROMPT, want_state)], [split.forward(PROMPT, got_state)]
    built = split._engine.programs_built
    token = int(np.argmax(want[0][-1]))
    for _ in range(31):  # positions 9 .. 39: keys 10 .. 40
        want.append(plain.forward(np.array([token]), want_state))
        got.append(split.forward(np.array([token]), got_state))
        token = int(np.argmax(want[-1][-1]))
    assert split.last_step_counts()["dispatches_by_kernel"].get("attention_decode_partial_f32_d256") == 1
    assert split._engine.programs_built - built == 3  # 8 blocks at 10 keys, 16 at 16, 32 at 32
    want, got = np.concatenate(want), np.concatenate(got)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


def test_split_kv_blocks_by_runtime(engine_backend, engine_runtime, checkpoints):
    """Both runtimes split decode attention from 256 keys (LILY_ATTN_SPLIT_MIN_KEYS). Metal doubles the blocks with
    every doubling of keys / 256: 2 at 256 keys, 8 at 1K, 16 at 2K, 32 at 4K, 64 from 8K. CUDA
    (Runtime::prefers_short_split_blocks) doubles them with keys / 64 (LILY_ATTN_SPLIT_SHORT_BLOCK_KEYS): 8 at 256,
    32 at 1K, 64 from 2K. split_kv_block_keys = 256 gives either the Metal rule (decode_ab's baseline on CUDA).
    Positions are keys - 1."""
    keys = (255, 256, 1024, 2048, 4096, 8192)
    metal_rule = [0, 2, 8, 16, 32, 64]
    want = {"cuda": [0, 8, 32, 64, 64, 64], "metal": metal_rule}[engine_runtime]
    for switches, expected in (({}, want), ({"split_kv_block_keys": 256}, metal_rule)):
        engine = engine_backend(checkpoints["mlx"], precision="float32", switches=switches)._engine
        assert [engine.split_blocks(k - 1) for k in keys] == expected, switches


def test_wide_and_narrow_gemm_tiles_agree(engine_backend, checkpoints):
    # 100 rows: 100*2/8 = 25 rows per expert selects 32-row grouped-GEMM tiles, and > 16 rows 32-row qmm tiles.
    checkpoint = checkpoints["mlx"]
    ids = np.random.default_rng(7).integers(0, checkpoint.args.vocab_size, 100)
    ref = ReferenceModel(checkpoint)
    want = ref.forward(ids, ref.new_state())
    results = {}
    for wide in (True, False):
        backend = engine_backend(checkpoint, precision="float32", switches={"wide_tiles": wide})
        results[wide] = backend.forward(ids, backend.new_state())
        kernels = backend.last_step_counts()["dispatches_by_kernel"]
        tiles = {name[-4:] for name in kernels if name.startswith(("qmm_", "moe_gemm_"))}
        assert tiles == ({"bm32"} if wide else {"bm16"})
        assert relative_error(results[wide], want) < 1e-3
    np.testing.assert_allclose(results[True], results[False], rtol=0, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.fake_metal
@pytest.mark.parametrize("seed", [1, 2])
def test_any_order_within_a_stage_gives_the_same_result(checkpoints, reference_run, seed):
    te.set_stage_order("shuffle", seed)  # dispatches of each stage run in a seeded order other than encoding order
    backend = MetalBackend(checkpoints["mlx"], precision="float32")
    want_logits, want_tokens = reference_run["mlx"]
    state = backend.new_state()
    assert relative_error(backend.forward(PROMPT, state), want_logits) < 1e-3
    assert backend.generate_greedy(state, want_tokens[0], 4) == want_tokens[1:5]


@pytest.mark.fake_metal
def test_a_removed_barrier_breaks_the_result(checkpoints, reference_run):
    backend = MetalBackend(checkpoints["mlx"], precision="float32")
    want_logits, _ = reference_run["mlx"]
    ids = PROMPT[:2]
    # Node 1 (the first layer's input norm) reads the embedding rows node 0 writes: without the barrier the fake
    # Metal runs the norm first, on stale data. (Two tokens: the prefill graph; one token: the decode graph.)
    broken = backend.forward(ids, backend.new_state(), dropped_barrier=1)
    assert relative_error(broken, want_logits[:2]) > 1e-2
    state = backend.new_state()
    broken_step = backend.forward(ids[:1], state, dropped_barrier=1)
    assert relative_error(broken_step, want_logits[:1]) > 1e-2
    # The same encoding with every barrier in place (manual placement from the graph) is right.
    good = backend.forward(ids, backend.new_state(), dropped_barrier=10**6)
    assert relative_error(good, want_logits[:2]) < 1e-3


def test_a_removed_dependency_edge_breaks_the_cuda_graph(cuda_engine_backend, checkpoints):
    # Node 1 (the first layer's input norm) waits for node 0 (the embedding) by one edge. Without it the fake libcuda
    # runs the two in a random order (a seed per launch): some launches run the norm first, on the stale hidden row
    # of the token before. One token: the decode graph (replayed); two: a prefill chunk (one-shot).
    backend = cuda_engine_backend(checkpoints["mlx"], precision="float32")
    if not os.environ.get("LILY_LIBCUDA") and real_driver():
        # Seen on the H200: the nodes still ran in order. Only the fake's random order makes the missing edge show.
        pytest.skip("on a GPU a missing edge may go unseen; the fake libcuda's random node order is what shows it")
    # Both nodes are ready at the start, so each launch runs the norm first with probability 1/2: launches go on until
    # one breaks, at most 40 (all 40 in order by chance: 2^-40; 6 launches in order happened, 1 in 64).
    for count in (1, 2):
        errors = []
        for attempt in range(40):
            ids = PROMPT[attempt % 6:attempt % 6 + count]
            broken = backend.forward(ids, backend.new_state(), dropped_barrier=1)
            good = backend.forward(ids, backend.new_state(), dropped_barrier=10**6)  # every edge in place
            errors.append(relative_error(broken, good))
            if not errors[-1] <= 1e-2:  # NaN: it read never-written memory
                break
        assert not errors[-1] <= 1e-2, (count, errors)


def test_prefill_stream_launches_agree_with_the_cuda_graph(cuda_engine_backend, checkpoints):
    # A prefill chunk runs once: the CUDA runtime launches its kernels in stream order. With a dropped barrier past
    # the last node (every edge in place) the same chunk is recorded as a CUDA graph, as the decode step is: the two
    # give the same bits.
    backend = cuda_engine_backend(checkpoints["mlx"], precision="float32")
    ids = PROMPT[:5]
    streamed = backend.forward(ids, backend.new_state())
    as_graph = backend.forward(ids, backend.new_state(), dropped_barrier=10**6)
    assert np.array_equal(streamed, as_graph)


def test_snapshots_copy_the_state(engine_backend, checkpoints, reference_run):
    backend = engine_backend(checkpoints["mlx"], precision="float32")
    want_logits, _ = reference_run["mlx"]
    state = backend.new_state()
    backend.forward(PROMPT[:4], state)
    fork = state.copy()
    other = backend.new_state()  # a third sequence in between evicts the live one
    backend.forward(PROMPT[:2], other)
    a = backend.forward(PROMPT[4:], state)
    b = backend.forward(PROMPT[4:], fork)
    np.testing.assert_array_equal(a, b)
    assert relative_error(a, want_logits[4:]) < 1e-3
    assert fork.position == state.position == len(PROMPT)


def test_kv_cache_grows_in_blocks_and_snapshots_follow(engine_backend, checkpoints, reference_run):
    # Blocks of 2 rows: the 7-token prompt grows the cache 3 times, one of them after a restore.
    backend = engine_backend(checkpoints["mlx"], precision="float32", switches={"kv_block": 2})
    want_logits, _ = reference_run["mlx"]
    state = backend.new_state()
    first = backend.forward(PROMPT[:3], state)
    saved = state.copy()
    backend.forward(PROMPT[3:5], backend.new_state())  # another sequence resets the live caches
    rest = backend.forward(PROMPT[3:], saved)
    assert relative_error(np.concatenate([first, rest]), want_logits) < 1e-3


def aligned_copy(source: Path, to: Path) -> Path:
    """`source` (a checkpoint folder) with each safetensors header padded by spaces so the data section starts on 16
    bytes, as the safetensors format allows; tensors and every other file unchanged."""
    to.mkdir()
    for path in source.iterdir():
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            header_length = int.from_bytes(data[:8], "little")
            padded = data[8 : 8 + header_length] + b" " * (-(8 + header_length) % 16)
            data = len(padded).to_bytes(8, "little") + padded + data[8 + header_length :]
        (to / path.name).write_bytes(data)
    return to


def test_an_mlx_file_is_shifted_to_aligned_tensors_and_an_aligned_file_is_mapped(engine_backend, checkpoints,
                                                                                  tmp_path):
    """MLX writes headers of any length (every tensor at an odd offset; GPUs want offsets aligned to what a kernel
    reads): such a file is loaded shifted (on Metal: copied), an aligned one is wrapped as mapped, and both compute
    the same logits, bit for bit."""
    unaligned = checkpoints["mlx"]
    header_length = int.from_bytes(unaligned.files[0].read_bytes()[:8], "little")
    assert (8 + header_length) % 16 != 0  # the case this test is about
    aligned = load_checkpoint(aligned_copy(unaligned.path, tmp_path / "aligned"))
    logits = {}
    for name, checkpoint in (("unaligned", unaligned), ("aligned", aligned)):
        backend = engine_backend(checkpoint, precision="float32")
        assert backend.mapped_files == [str(f) for f in checkpoint.files]
        assert backend.shifted_files == ([str(f) for f in checkpoint.files] if name == "unaligned" else [])
        logits[name] = backend.forward(PROMPT, backend.new_state())
    np.testing.assert_array_equal(logits["unaligned"], logits["aligned"])


def test_weights_are_mapped_not_copied(engine_backend, checkpoints):
    checkpoint = checkpoints["mlx"]
    backend = engine_backend(checkpoint, precision="float32")
    assert backend.mapped_files == [str(f) for f in checkpoint.files]
    # Materialised: only the small dense tensors not stored as f32 (norms, conv weights, A_log, dt_bias in bf16),
    # widened to f32 for float32 mode; every quantized tensor is a range of the mapped file.
    weights = checkpoint.weights
    widened = sum(
        int(np.prod(weights.shape(n))) * 4
        for n in weights
        if not weights.is_quantized(n) and weights.dtype(n) != "float32"
    )
    assert backend.materialised_bytes == widened


def test_bfloat16_mode_maps_an_mlx_checkpoint_without_copies(engine_runtime, engine_backend, checkpoints):
    """bf16 mode on an MLX 4-bit checkpoint: every quantized tensor (fused projections included: the segmented GEMVs
    bind each part's own bytes) and every bf16 dense tensor is a range of the mapped file; only dense tensors stored
    in another dtype than the kernels take (A_log, dt_bias: f32) are converted."""
    checkpoint = checkpoints["mlx"]
    backend = engine_backend(checkpoint, precision="bfloat16", switches={"fused_projections": True})
    weights = checkpoint.weights

    def wanted(name: str) -> str:
        return "float32" if name.endswith(("A_log", "dt_bias")) else "bfloat16"

    converted = sum(
        int(np.prod(weights.shape(n))) * (4 if wanted(n) == "float32" else 2)
        for n in weights
        if not weights.is_quantized(n) and weights.dtype(n) != wanted(n)
    )
    file_bytes = sum(f.stat().st_size for f in checkpoint.files)
    assert backend.materialised_bytes == converted
    assert backend.materialised_bytes < 0.01 * file_bytes
    backend.forward(PROMPT[:1], backend.new_state())  # one decode step: the fused projections are segmented GEMVs
    segmented = "qmv_norm_seg_staged_q4_g64_bf16" if engine_runtime == "cuda" else "qmv_norm_seg_q4_g64_bf16"
    counts = backend.last_step_counts()["dispatches_by_kernel"]
    assert counts.get(segmented, 0) + counts.get(segmented + "_a16", 0) > 0  # _a16: codes on 16 bytes (CUDA)


@pytest.mark.fake_metal
def test_the_engine_releases_every_metal_object(checkpoints):
    import gc

    gc.collect()
    baseline = te.live_objects()
    backend = MetalBackend(checkpoints["mlx"], precision="float32")
    state = backend.new_state()
    backend.forward(PROMPT[:3], state)
    backend.generate_greedy(state, 1, 2)
    assert te.live_objects() > baseline
    del backend, state
    gc.collect()
    assert te.live_objects() == baseline


def test_bad_input_is_one_clear_error(engine_backend, checkpoints, tmp_path):
    backend = engine_backend(checkpoints["mlx"], precision="float32", max_context=4)
    with pytest.raises(ValueError, match="token_ids must lie in"):
        backend.forward(np.array([640]), backend.new_state())
    with pytest.raises(ValueError, match="context limit is 4"):
        backend.forward(PROMPT[:5], backend.new_state())
    with pytest.raises(ValueError, match="unknown engine switch 'turbo'"):
        engine_backend(checkpoints["mlx"], switches={"turbo": False})
    with pytest.raises(ValueError, match="state was not made by this backend"):
        backend.forward(PROMPT[:1], ReferenceModel(checkpoints["mlx"]).new_state())
    # The kernels are built for key head dims 128 and 64: the tiny dk32 fixture is refused by name.
    dk32 = save_hf_checkpoint(build_hf_model("dk32", randomize=False), tmp_path / "dk32", dtype="bfloat16")
    with pytest.raises(ValueError, match="linear_key_head_dim"):
        engine_backend(load_checkpoint(dk32, quantize=4), precision="float32")


def test_cpu_routing_round_trip_matches_the_gpu_sort(engine_backend, checkpoints):
    # 40 rows in chunks of 20 (two chunks, each with several 16-row tiles per expert): the CPU builds the sort
    # between command buffers instead of moe_sort_count/scan/scatter, and the result is bit-identical.
    checkpoint = checkpoints["mlx"]
    ids = np.random.default_rng(11).integers(0, checkpoint.args.vocab_size, 40)
    results, kernels = {}, {}
    for gpu in (True, False):
        backend = engine_backend(checkpoint, precision="float32", switches={"gpu_routing": gpu, "prefill_chunk": 20})
        results[gpu] = backend.forward(ids, backend.new_state())
        kernels[gpu] = backend.last_step_counts()["dispatches_by_kernel"]
    assert kernels[True]["moe_sort_scatter_u32"] == len(checkpoint.args.layer_types)
    assert not any(name.startswith("moe_sort_") for name in kernels[False])
    np.testing.assert_array_equal(results[False], results[True])


def test_whole_prompt_prefill_grows_the_chunk_scratch(engine_backend, checkpoints, reference_run):
    # Chunk size 2 with chunking off: a 3-token prompt, then the 6 others as one chunk each (the scratch grows).
    backend = engine_backend(checkpoints["mlx"], precision="float32",
                           switches={"prefill_chunk": 2, "chunked_prefill": False})
    want_logits, _ = reference_run["mlx"]
    state = backend.new_state()
    first = backend.forward(PROMPT[:3], state)
    assert backend.last_step_counts()["dispatches_by_kernel"]["embedding_gather_q4_g64_f32"] == 1
    rest = backend.forward(PROMPT[3:], state)
    assert relative_error(np.concatenate([first, rest]), want_logits) < 1e-3


def test_bfloat16_mode_follows_the_reference(engine_backend, checkpoints, reference_run):
    # bf16 activations and KV cache, f32 router logits and DeltaNet state: prefill and decode stay within bf16
    # rounding of the fp32 reference and choose the same next tokens.
    backend = engine_backend(checkpoints["mlx"])
    assert backend.precision == "bfloat16"
    want_logits, want_tokens = reference_run["mlx"]
    state = backend.new_state()
    logits = backend.forward(PROMPT, state)
    kernels = backend.last_step_counts()["dispatches_by_kernel"]
    # f32 outputs: the router logits (8-bit) and the logits (lm_head, 4-bit), 9 rows: the GEMMs of 16-row tiles; the
    # shared-expert gate (N = 1) on the GEMV.
    assert {name for name in kernels if "_of32" in name} == {"qmm_q8_g64_bf16_of32_bm16", "qmm_q4_g64_bf16_of32_bm16",
                                                             "qmv_q8_g64_bf16_of32"}
    assert relative_error(logits, want_logits) < 5e-2  # measured 2.2e-2
    assert np.mean(logits.argmax(-1) == want_logits.argmax(-1)) >= 8 / 9
    ref = ReferenceModel(checkpoints["mlx"])
    ref_state = ref.new_state()
    ref.forward(PROMPT, ref_state)
    step = backend.forward(np.array([want_tokens[0]]), state)  # the decode graph
    want_step = ref.forward(np.array([want_tokens[0]]), ref_state)
    assert relative_error(step, want_step) < 5e-2  # measured 1.4e-2
    assert int(np.argmax(step[-1])) == want_tokens[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kv64_fixture_in_the_hf_layout_matches_the_reference(engine_backend, tmp_path, dtype):
    # The tiny kv64 fixture (head dim 64, DeltaNet dk 64) in the HF layout, quantized on load: bf16 scales from a
    # bf16 file, f32 scales ("_sf32" kernels) from an f32 file. (tests/engine/test_metal_head_dims.py runs the MLX
    # layouts of kv64 and gqa4.)
    checkpoint = load_checkpoint(save_hf_checkpoint(build_hf_model("kv64", seed=9), tmp_path, dtype=dtype), quantize=4)
    ids = np.random.default_rng(5).integers(0, checkpoint.args.vocab_size, 9)
    ref = ReferenceModel(checkpoint)
    ref_state = ref.new_state()
    want = ref.forward(ids, ref_state)
    tokens = [int(np.argmax(want[-1]))]
    for _ in range(5):
        tokens.append(int(np.argmax(ref.forward(np.array([tokens[-1]]), ref_state)[-1])))
    backend = engine_backend(checkpoint, precision="float32")
    state = backend.new_state()
    assert relative_error(backend.forward(ids, state), want) < 1e-3
    assert [tokens[0]] + backend.generate_greedy(state, tokens[0], 5) == tokens


def test_a_mixed_bit_router_runs_on_the_general_kernels(engine_backend, checkpoints, monkeypatch):
    # The router at 4 bits next to an 8-bit shared-expert gate (mlx-lm quantizes both at 8): the bf16 prefill router
    # runs the 4-bit "_of32" GEMM, and the decode's fused router | shared-gate GEMV, which needs matrices quantized
    # alike, falls back to one GEMV per matrix. Both modes follow the reference on the same weights.
    monkeypatch.setattr(lily.checkpoint, "_EIGHT_BIT", re.compile(r"\.mlp\.shared_expert_gate\.weight$"))
    checkpoint = load_checkpoint(checkpoints["hf"].path, quantize=4)
    assert checkpoint.weights.quantization("layers.0.mlp.gate.weight")[0] == 4
    assert checkpoint.weights.quantization("layers.0.mlp.shared_expert_gate.weight")[0] == 8
    ref = ReferenceModel(checkpoint)
    ref_state = ref.new_state()
    want = ref.forward(PROMPT, ref_state)
    want_step = ref.forward(np.array([int(np.argmax(want[-1]))]), ref_state)
    for precision, tolerance in (("float32", 1e-3), ("bfloat16", 5e-2)):
        backend = engine_backend(checkpoint, precision=precision)
        state = backend.new_state()
        logits = backend.forward(PROMPT, state)
        prefill_kernels = backend.last_step_counts()["dispatches_by_kernel"]
        step = backend.forward(np.array([int(np.argmax(want[-1]))]), state)
        decode_kernels = backend.last_step_counts()["dispatches_by_kernel"]
        assert relative_error(logits, want) < tolerance and relative_error(step, want_step) < tolerance, precision
        assert int(np.argmax(step[-1])) == int(np.argmax(want_step[-1])), precision
        if precision == "bfloat16":
            layers = len(checkpoint.args.layer_types)
            # Each layer's 4-bit router logits and the f32 logits (lm_head); in decode, staged on CUDA.
            assert prefill_kernels.get("qmm_q4_g64_bf16_of32_bm16") == layers + 1, sorted(prefill_kernels)
            assert prefill_kernels.get("qmv_q8_g64_bf16_of32") == layers, sorted(prefill_kernels)  # N = 1
            of32 = sum(decode_kernels.get(f"qmv_norm{staged}_q4_g64_bf16_of32{loads}", 0)
                       for staged, loads in (("", ""), ("_staged", ""), ("_staged", "_a16")))
            assert of32 == layers + 1, sorted(decode_kernels)
            assert decode_kernels.get("qmv_norm_q8_g64_bf16_of32") == layers, sorted(decode_kernels)


@pytest.mark.metal
def test_model_load_sets_the_engine_context_limit(checkpoints):
    """Model.load(max_context=N): N tokens fit in the engine's KV cache, N + 1 are refused naming the limit."""
    import lily

    limit = len(PROMPT)
    model = lily.Model.load(checkpoints["mlx"].path, backend="metal", precision="float32", max_context=limit)
    assert model.logits(PROMPT.tolist()).shape == (limit, HEAD_SHAPES_CONFIG["vocab_size"])
    with pytest.raises(ValueError, match=f"context limit is {limit} tokens; this call needs {limit + 1}"):
        model.logits(PROMPT.tolist() + [1])


def test_profile_prefill_times_every_node_and_changes_no_result(engine_backend, engine_runtime, checkpoints):
    """lily bench --profile: on the cuda runtime every node of the prefill is timed once, and running the nodes one by
    one gives the graph's logits; the metal runtime says it cannot (the cpu runtime: tests/test_cpu_backend.py)."""
    backend = engine_backend(checkpoints["mlx"], precision="float32")
    if engine_runtime != "cuda":
        assert not backend.supports_profiling
        with pytest.raises(ValueError, match="needs the cuda or cpu runtime"):
            backend.profile_prefill(PROMPT)
        return
    times = backend.profile_prefill(PROMPT)
    kernels = backend.last_step_counts()["dispatches_by_kernel"]
    assert Counter(kernel for kernel, _, _ in times) == Counter(kernels)
    assert all(ms >= 0 for _, _, ms in times) and sum(ms for _, _, ms in times) > 0
    with pytest.raises(ValueError, match="at least 2 tokens"):
        backend.profile_prefill(PROMPT[:1])
    want = backend.forward(PROMPT, backend.new_state())
    backend._engine.set_profiling(True)
    try:
        got = backend.forward(PROMPT, backend.new_state())
    finally:
        backend._engine.set_profiling(False)
    np.testing.assert_array_equal(got, want)
