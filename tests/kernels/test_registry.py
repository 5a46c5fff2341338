"""Every instantiated kernel is registered, has an engine path, and is executed by the tests.

Host names are read from metal/*.metal by tools/msl_text.py (`host_names`, the one reader of them) and must equal
`lily._ext.msl.kernel_names()`. A name has an engine path when a graph the engine builds dispatches it
(`lily._ext.graph_kernels`: decode steps and prefill chunks over the model's shapes, both precisions, 4/8-bit
weights, bf16/f32 scales and every switch; graphs are built as on a GPU with tensor ops unless TENSOR_OPS is off). A name is tested when the harness ran it during the test session
(`msl.executions()`); that check runs last in the session, or runs the kernel tests in a subprocess when the
session did not collect them.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lily import _ext
from lily._ext import msl
from lily.config import ModelArgs
from lily.backends import engine_config
from lily.backends.engine import SWITCHES, engine_switches
from lily.plan import FULL_SIZE_CONFIG

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from msl_text import host_names  # noqa: E402

# Prefill chunk sizes around the GEMV/GEMM, 16/32-row tile, matrix-unit attention and MoE tile thresholds.
PREFILL_ROWS = [2, 8, 16, 17, 33, 64, 300]


def built_here(name: str) -> bool:
    """Whether the session's device builds kernel `name`: the Metal 4 tensor-op kernels (qmm_nax) have no CUDA build,
    as their cases skip there (tests/kernels/conftest.py)."""
    return os.environ.get("LILY_KERNEL_DEVICE") != "cuda" or not name.startswith("qmm_nax_")


def source_host_names() -> list[str]:
    return [name for path in sorted((ROOT / "metal").glob("*.metal")) for name in host_names(path.read_text())
            if built_here(name)]


def test_sources_and_registry_agree() -> None:
    names = source_host_names()
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"host names instantiated twice: {duplicates}"
    registered = msl.kernel_names()
    assert sorted(names) == registered, (
        f"only in metal/*.metal: {sorted(set(names) - set(registered))}; "
        f"only in the registry: {sorted(set(registered) - set(names))}"
    )
    assert not set(registered) & set(msl.test_kernel_names()), "harness self-test kernels leaked into the registry"


def engine_configs() -> list:
    """The model's shapes (head dim 256, DeltaNet dk 128) and the demo model's (64, 64), at a small width."""
    small = copy.deepcopy(FULL_SIZE_CONFIG)
    small.update(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], head_dim=64,
                 linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=1024, hidden_size=256, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                 num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4)
    # Head ratios the packed attention kernels cannot split (3 at head dim 64 and 256, 1): the general kernels.
    ratio3_d64 = {**small, "num_attention_heads": 6, "num_key_value_heads": 2}
    ratio3_d256 = {**ratio3_d64, "head_dim": 256}
    ratio1 = {**small, "num_attention_heads": 2, "num_key_value_heads": 2}
    return [engine_config(ModelArgs.from_dict(FULL_SIZE_CONFIG, source="full size")),
            engine_config(ModelArgs.from_dict(small, source="demo shapes"))] + [
        engine_config(ModelArgs.from_dict(c, source="head ratio")) for c in (ratio3_d64, ratio3_d256, ratio1)]


@functools.cache  # thousands of graphs (about 75 s here): built once for the two tests that read them
def engine_kernels() -> frozenset[str]:
    """Every kernel some graph of the engine dispatches (configurations the engine refuses are no paths)."""
    switch_sets = [{}] + [{name: False} for name in SWITCHES]
    # Synthetic weights lie on 16 bytes: the staged kernels' word-load twins are the ones a file with codes off 16
    # bytes gets (tuning::whole_pack_loads), on every path.
    switch_sets += [{**s, "whole_pack_loads": False} for s in switch_sets[1:]]
    # Apple GPUs run the unstaged GEMVs (Runtime::prefers_staged_gemv is CUDA's): every switch on that path too.
    switch_sets += [{**s, "staged_gemv": False} for s in switch_sets]
    switch_sets += [{"split_kv_min_keys": 1, **extra} for extra in ({}, {"gqa_packing": False}, {"coalesced_kv": False})]
    found: set[str] = set()
    for config in engine_configs():
        for precision in ("float32", "bfloat16"):
            for bits in (0, 4, 8):
                for f32_scales in (False, True):
                    for switches in switch_sets:
                        try:
                            found |= set(_ext.graph_kernels(config, precision, engine_switches(switches), bits,
                                                            f32_scales, PREFILL_ROWS))
                        except RuntimeError as exc:
                            assert "needs 8-bit router weights" in str(exc), exc  # the one refusal expected
    return frozenset(found)


# Kernels the engine dispatches outside its graphs, and the file that does it.
ENGINE_DIRECT = {"simdgroup_layout_probe": "src/lily_ext/layout_probe.cpp"}  # once per device, at load


def test_every_kernel_has_an_engine_path() -> None:
    dispatched = {name for name in engine_kernels() if built_here(name)}
    registered = set(msl.kernel_names())
    assert dispatched <= registered, f"graphs name unregistered kernels: {sorted(dispatched - registered)}"
    for kernel, path in ENGINE_DIRECT.items():
        assert f'"{kernel}"' in (ROOT / path).read_text(), f"{path} no longer dispatches {kernel}"
    missing = registered - dispatched - set(ENGINE_DIRECT)
    assert not missing, f"instantiated but dispatched by no engine path (remove them or give them one): {sorted(missing)}"


def kernel_test_coverage() -> tuple[list[str], list[str]]:
    """(every registered kernel name, the names the harness has run in this process)."""
    names = msl.kernel_names()
    runs = msl.executions()
    return names, [n for n in names if runs.get(n, 0) > 0]


def kernel_test_modules() -> set[str]:
    return {p.name for p in (ROOT / "tests" / "kernels").glob("test_*.py") if p.name != Path(__file__).name}


def test_every_kernel_was_executed(request, tmp_path) -> None:
    collected = {Path(str(item.fspath)).name for item in request.session.items}
    if kernel_test_modules() <= collected:
        names, executed = kernel_test_coverage()  # this test runs last (tests/kernels/conftest.py)
    else:
        record = tmp_path / "executions.json"
        me = f"{Path(__file__).relative_to(ROOT)}::test_every_kernel_was_executed"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels",
                               "--deselect", me], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "LILY_KERNEL_EXECUTIONS": str(record)})
        assert proc.returncode == 0, proc.stdout[-3000:]
        runs = json.loads(record.read_text())
        names = msl.kernel_names()
        executed = [n for n in names if runs.get(n, 0) > 0]
    assert names, "no kernels registered"
    assert executed == names, f"kernels no test executed: {sorted(set(names) - set(executed))}"


def test_a_kernel_nothing_runs_or_dispatches_fails_both_checks(monkeypatch) -> None:
    """The checks can fail: a registered name no graph dispatches and no test runs is reported by both."""
    fake = "qmv_q4_g64_f64"
    monkeypatch.setattr(msl, "kernel_names", lambda: sorted([*_REAL_NAMES, fake]))
    with pytest.raises(AssertionError, match=fake):
        test_every_kernel_has_an_engine_path()
    names, executed = kernel_test_coverage()
    assert fake in names and fake not in executed


_REAL_NAMES = msl.kernel_names()
