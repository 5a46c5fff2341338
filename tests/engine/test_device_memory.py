"""What the GPU backends report holding in device memory (`device_memory()`, `lily bench`'s peak GB), against what
the checkpoint's files and the config say they must hold: the weights are the files as loaded, the KV cache is the
attention layers' K and V rows at the cache's capacity (it grows in blocks), and the peak covers the moment of a
growth when a layer's old and new cache are both held. Runs on each runtime (`engine_runtime`)."""

from __future__ import annotations

import math

import pytest
from safetensors import safe_open

from lily import Model, bench
from lily.checkpoint import load_checkpoint
from lily.plan import plan_decode

from tests.engine.test_metal_head_dims import DEMO

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)

PAGE = 16384  # the runtimes pad a loaded file to this page at most


def kv_cache_bytes(args, rows: int, element_bytes: int) -> int:
    attention_layers = sum(kind == "full_attention" for kind in args.layer_types)
    return attention_layers * 2 * args.num_key_value_heads * rows * args.head_dim * element_bytes


def test_device_memory_counts_the_weights_and_the_kv_cache_as_it_grows(engine_backend):
    checkpoint = load_checkpoint(DEMO)
    args = checkpoint.args
    files = sum(path.stat().st_size for path in checkpoint.files)
    backend = engine_backend(checkpoint, precision="bfloat16", switches={"kv_block": 4})
    loaded = backend.device_memory()
    assert files <= loaded["weights"] <= files + len(checkpoint.files) * PAGE
    assert loaded["kv_cache"] == kv_cache_bytes(args, 4, 2)
    assert loaded["state"] > 0 and loaded["scratch"] > 0
    assert loaded["total"] == sum(loaded[k] for k in ("weights", "kv_cache", "state", "scratch"))
    assert loaded["peak"] == loaded["total"]

    state = backend.new_state()
    backend.forward([1, 2], state)  # a prefill chunk: its buffers; the cache still holds 4 rows
    before = backend.device_memory()
    assert before["kv_cache"] == loaded["kv_cache"] and before["scratch"] > loaded["scratch"]
    backend.forward([3, 4, 5, 6, 7, 8], state)  # 8 rows: the cache grows to 8, buffer by buffer
    after = backend.device_memory()
    assert after["kv_cache"] == kv_cache_bytes(args, 8, 2)
    assert {k: after[k] for k in ("weights", "state", "scratch")} == {k: before[k] for k in ("weights", "state",
                                                                                              "scratch")}
    # The last buffer to grow: every other one already new, and this one old and new at once.
    buffers = 2 * sum(kind == "full_attention" for kind in args.layer_types)
    assert after["peak"] == after["total"] + loaded["kv_cache"] // buffers

    # float32 mode holds f32 K/V rows.
    assert engine_backend(checkpoint, precision="float32").device_memory()["kv_cache"] >= kv_cache_bytes(args, 4, 4)


def test_bench_reports_the_device_peak_and_the_host_beside_it(engine_runtime):
    model = Model.load("lily:demo", backend=engine_runtime, progress=False)
    (row,) = bench.run_bench(model, prompts=(4,), gens=(), repetitions=1)
    assert row.peak_memory == pytest.approx(model.backend.device_memory()["peak"] / 1e9)
    assert row.host_memory > 0 and row.as_dict()["host_memory"] == row.host_memory


def tensor_bytes(checkpoint) -> int:
    """The bytes of every tensor in the checkpoint's files, from their safetensors headers."""
    total = 0
    for path in checkpoint.files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                total += math.prod(tensor.get_shape()) * DTYPE_BYTES[tensor.get_dtype()]
    return total


DTYPE_BYTES = {"U32": 4, "F32": 4, "BF16": 2, "F16": 2, "U8": 1}


def test_plan_states_what_the_loaded_engine_holds(engine_backend):
    """`lily plan`'s memory is the engine's own accounting of the same decode buffers: equal to what a loaded engine
    holds at the same KV capacity; its weights are the checkpoint's tensors."""
    checkpoint = load_checkpoint(DEMO)
    held = engine_backend(checkpoint, precision="bfloat16").device_memory()
    plan = plan_decode(checkpoint.args, context=5)
    assert plan["kv_capacity"] * plan["kv_bytes_per_token"] == held["kv_cache"]
    assert {k: plan["memory"][k] for k in ("kv_cache", "state", "scratch")} == {
        k: held[k] for k in ("kv_cache", "state", "scratch")}
    # The plan's synthetic table holds a few per-head vectors (dt_bias) in f32 where this file has bf16.
    assert plan["memory"]["weights"] == pytest.approx(tensor_bytes(checkpoint), rel=1e-4)

