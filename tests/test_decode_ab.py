"""scripts/decode_ab.py without a GPU: its variant syntax, and one A/B of the demo model on the fake libcuda (the
engine's CUDA runtime on the CPU harness) whose variants differ in an environment switch and a tuning option, each
loading with its own (the dispatch count each step records shows which ran)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.runtimes import fake_libcuda, real_driver

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import decode_ab  # noqa: E402


def test_a_variant_names_its_ptx_environment_and_switches() -> None:
    assert decode_ab.parse_variant("base=/p,LILY_DISABLE_FUSED_ATTENTION_PREP=1,sw.split_kv_min_keys=512,"
                                   "sw.fused_attention_prep=0") == (
        "base", "/p", {"LILY_DISABLE_FUSED_ATTENTION_PREP": "1"},
        {"split_kv_min_keys": 512, "fused_attention_prep": False})
    assert decode_ab.parse_variant("x=/p,sw.mma_attention=1")[3] == {"mma_attention": True}
    for bad in ("base", "=/p", "base=/p,LILY_X", "base=/p,sw.split_kv_min_keys=many"):
        with pytest.raises((SystemExit, ValueError)):
            decode_ab.parse_variant(bad)


def test_token_boundaries_measure_the_idle_time_before_each_step() -> None:
    def event(name: str, ts: float, dur: float) -> dict:
        return {"name": name, "ts": ts, "dur": dur}
    events = [event("embedding_gather_q4_g64_bf16", 0, 5), event("qmv_a", 4, 10), event("argmax_final_f32", 14, 3),
              event("Memcpy HtoD (Pinned -> Device)", 20, 2), event("embedding_gather_q4_g64_bf16", 30, 5),
              event("qmv_a", 35, 50), event("qmv_b", 40, 20),  # the latest end is 85, not the last one started
              event("embedding_gather_q4_g64_bf16", 92, 5)]
    assert decode_ab.token_boundaries(events) == ([30 - 17, 92 - 85], [2, 0])
    assert decode_ab.token_boundaries(events[:3]) == ([], [])


def run_on_the_fake_libcuda(ptx: str, *arguments: str) -> subprocess.CompletedProcess:
    """decode_ab.py on the demo model with `arguments`, its kernels from `ptx` run by the fake libcuda."""
    fake = fake_libcuda()
    assert fake is not None, "a Linux test build has the fake libcuda"
    env = {**os.environ, "LILY_LIBCUDA": str(fake), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode_ab.py"), "--model",
                          str(ROOT / "python" / "lily" / "demo"), "--gen", "3", "--warmup", "2", *arguments],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def greedy_ab(cuda_compile_only) -> tuple[str, subprocess.CompletedProcess]:
    code, _, ptx = cuda_compile_only
    assert code == 0
    return ptx, run_on_the_fake_libcuda(
        ptx, "--depths", "0,20", "--rounds", "2", f"fused={ptx},sw.split_kv_min_keys=1",
        f"unfused={ptx},LILY_DISABLE_FUSED_ATTENTION_PREP=1,sw.split_kv_min_keys=1", f"single={ptx}")


@pytest.mark.skipif(real_driver(), reason="runs on the fake libcuda; a GPU machine runs the script itself")
def test_an_ab_of_the_demo_model_on_the_fake_libcuda(greedy_ab) -> None:
    _, out = greedy_ab
    loaded = re.findall(r"^loaded (\w+) .*?: (\d+) dispatches per token at depth 0, "
                        r"(\d+) dispatches per token at depth 20$", out.stdout, re.M)
    dispatches = {name: (int(d0), int(d20)) for name, d0, d20 in loaded}
    assert len(dispatches) == 3, out.stdout
    # The demo model's 2 full-attention layers, split: one attention_prep each when unfused; the single pass has its
    # prep and no combine. At both depths: each is the step recorded there.
    layers = 2
    for at in (0, 1):  # depth 0, depth 20
        assert dispatches["unfused"][at] == dispatches["fused"][at] + layers, out.stdout
        assert dispatches["single"][at] == dispatches["fused"][at], out.stdout
    for depth in (0, 20):
        table = out.stdout.split(f"== tg3 @ d{depth}, median of 2 (tok/s, ratio to fused)\n", 1)[1].splitlines()[:3]
        assert [row.split()[0] for row in table] == ["fused", "unfused", "single"], out.stdout
        assert float(table[0].split()[2]) == 1.0 and all(float(row.split()[1]) > 0 for row in table)


@pytest.mark.skipif(real_driver(), reason="runs on the fake libcuda; a GPU machine runs the script itself")
def test_sampled_decodes_choose_tokens_with_the_sampler(greedy_ab) -> None:
    """--sampled records and times the step whose token comes from the GPU's sampler: more dispatches than the greedy
    step of the same model (sample_partial and sample_final where the greedy lm_head keeps its argmax and
    argmax_final reduces it)."""
    ptx, greedy = greedy_ab
    out = run_on_the_fake_libcuda(ptx, "--sampled", "--depths", "0", "--rounds", "1", f"single={ptx}")
    greedy_count = int(re.search(r"^loaded single .*?: (\d+) dispatches per token at depth 0,", greedy.stdout,
                                 re.M).group(1))
    sampled_count = int(re.search(r"^loaded single .*?: (\d+) dispatches per token at depth 0$", out.stdout,
                                  re.M).group(1))
    assert sampled_count == greedy_count + 1, (greedy_count, out.stdout)
    assert "== tg3 sampled (T 0.7, top-p 0.9, top-k 50) @ d0, median of 1 (tok/s, ratio to single)" in out.stdout


@pytest.mark.skipif(real_driver(), reason="runs on the fake libcuda; a GPU machine runs the script itself")
def test_prefill_ab_times_prompt_passes(greedy_ab) -> None:
    """--prefill N times pp<N> after the depth's context: with prefill attention split into key blocks (16 keys a
    block here) the pass has one more dispatch per attention layer (attention_decode_combine) than the single pass."""
    ptx, _ = greedy_ab
    out = run_on_the_fake_libcuda(ptx, "--prefill", "9", "--depths", "40", "--rounds", "1",
                                  f"split={ptx},sw.split_prefill_block_keys=16",
                                  f"single={ptx},LILY_DISABLE_SPLIT_PREFILL_KV=1")
    counts = dict(re.findall(r"^loaded (\w+) .*?: (\d+) dispatches per pass at depth 40$", out.stdout, re.M))
    assert int(counts["split"]) == int(counts["single"]) + 2, out.stdout  # the demo's 2 attention layers
    table = out.stdout.split("== pp9 @ d40, median of 1 (tok/s, ratio to split)\n", 1)[1].splitlines()[:2]
    assert [row.split()[0] for row in table] == ["split", "single"], out.stdout
