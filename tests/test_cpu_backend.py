"""The ``cpu`` backend (lily.backends.cpu: the engine on its CPU runtime) against lily.reference on the tiny random
checkpoints.

float32 logits within 1e-4 relative and identical greedy tokens, in every checkpoint layout the engine runs (MLX
4-bit with bf16 or f32 scales; HF fp32 / fp16 / bf16 per-expert checkpoints quantized on load), on both instruction
sets (AVX2 and the portable loops), on 1 and 2 threads, in any chunking of the prompt, and through sessions
(snapshot, restore, save, load) and the user path (`backend="auto"` picks it off a Mac). Checkpoints the engine's
kernels do not take (8-bit experts, dense HF weights not quantized on load) are refused by name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import lily
import lily.cli
from lily import _ext
from lily.checkpoint import load_checkpoint
from lily.backends.cpu import CpuBackend, default_threads
from lily.reference import KV_CACHE_MIN_CAPACITY, ReferenceModel

from fixtures import relative_error

LOGITS_TOLERANCE = 1e-4
GREEDY_STEPS = 12
# The widest instruction set this CPU has is the default (lily._ext.cpu.isa()); every narrower one is tested too.
DEFAULT_ISA = _ext.cpu.isa()
ISAS = ["portable"] + {"avx512": ["avx2", "avx512"], "avx2": ["avx2"]}.get(DEFAULT_ISA, [])


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test on one instruction set, then restore the default."""
    before = _ext.cpu.isa()
    _ext.cpu.set_isa(request.param)
    yield request.param
    _ext.cpu.set_isa(before)


def reference_run(checkpoint, prompt: np.ndarray, steps: int = GREEDY_STEPS) -> tuple[np.ndarray, list, list]:
    """Reference prompt logits, greedy tokens and the logits of each decode step."""
    ref = ReferenceModel(checkpoint)
    state = ref.new_state()
    logits = ref.forward(prompt, state)
    tokens, steps_logits = [int(np.argmax(logits[-1]))], []
    for _ in range(steps - 1):
        steps_logits.append(ref.forward(np.array([tokens[-1]]), state)[0])
        tokens.append(int(np.argmax(steps_logits[-1])))
    return logits, tokens, steps_logits


def cpu_run(backend: CpuBackend, prompt: np.ndarray, steps: int = GREEDY_STEPS) -> tuple[np.ndarray, list, list]:
    state = backend.new_state()
    logits = backend.forward(prompt, state)
    tokens, steps_logits = [int(np.argmax(logits[-1]))], []
    for _ in range(steps - 1):
        steps_logits.append(backend.forward(np.array([tokens[-1]]), state)[0])
        tokens.append(int(np.argmax(steps_logits[-1])))
    assert state.position == len(prompt) + steps - 1
    return logits, tokens, steps_logits


def assert_agree(got, want) -> None:
    logits, tokens, steps = got
    want_logits, want_tokens, want_steps = want
    assert logits.dtype == np.float32 and logits.shape == want_logits.shape
    assert np.isfinite(logits).all()
    assert relative_error(logits, want_logits) < LOGITS_TOLERANCE
    assert tokens == want_tokens
    assert relative_error(np.stack(steps), np.stack(want_steps)) < LOGITS_TOLERANCE


def checkpoint_of(tiny_checkpoints, layout: str, variant: str = "kv64"):
    if layout == "mlx4":
        return load_checkpoint(tiny_checkpoints.mlx(variant, bits=4, dtype="bfloat16"))
    if layout == "mlx4_f32_scales":
        return load_checkpoint(tiny_checkpoints.mlx(variant, bits=4, dtype="float32"))
    # The engine runs quantized weights: HF checkpoints are quantized on load, as on the GPU backends.
    if layout == "hf_f32":
        return load_checkpoint(tiny_checkpoints.hf(variant, dtype="float32"), quantize=4)
    if layout == "hf_f16":
        return load_checkpoint(tiny_checkpoints.hf(variant, dtype="float16"), quantize=4)
    if layout == "hf_bf16_per_expert":
        return load_checkpoint(tiny_checkpoints.hf(variant, layout="per_expert", dtype="bfloat16"), quantize=4)
    if layout == "hf_quantized_on_load":
        return load_checkpoint(tiny_checkpoints.hf(variant, dtype="bfloat16"), quantize=4)
    raise KeyError(layout)


@pytest.mark.parametrize(
    "layout", ["mlx4", "mlx4_f32_scales", "hf_f32", "hf_f16", "hf_bf16_per_expert", "hf_quantized_on_load"]
)
def test_logits_and_greedy_tokens_match_the_reference(tiny_checkpoints, layout, isa):
    checkpoint = checkpoint_of(tiny_checkpoints, layout)
    prompt = np.random.default_rng(hash(layout) % 1000).integers(0, checkpoint.args.vocab_size, 11)
    backend = CpuBackend(checkpoint)
    assert_agree(cpu_run(backend, prompt), reference_run(checkpoint, prompt))
    # Matrices are read where the file maps them, at any alignment; only the dense vectors stored in bf16 (norms,
    # conv taps) are widened to float32 copies.
    if layout.startswith("mlx"):
        weights = checkpoint.weights
        widened = sum(4 * int(np.prod(weights.shape(n))) for n in weights
                      if not weights.is_quantized(n) and weights.dtype(n) != "float32")
        assert backend.owned_bytes == widened


def test_checkpoints_the_kernels_do_not_take_are_refused_by_name(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"switch_mlp\.\w+_proj\.weight: the MoE kernels take 4-bit experts; got 8-bit"):
        CpuBackend(load_checkpoint(tiny_checkpoints.mlx("kv64", bits=8, dtype="bfloat16")))
    with pytest.raises(ValueError, match="is not quantized; the engine runs 4/8-bit checkpoints"):
        CpuBackend(load_checkpoint(tiny_checkpoints.hf("kv64", dtype="float32")))


@pytest.mark.parametrize("variant", ["dk32", "gqa4", "d96"])
def test_other_head_shapes_match_the_reference(tiny_checkpoints, variant, isa):
    checkpoint = checkpoint_of(tiny_checkpoints, "mlx4", variant)
    prompt = np.random.default_rng(7).integers(0, checkpoint.args.vocab_size, 9)
    assert_agree(cpu_run(CpuBackend(checkpoint), prompt), reference_run(checkpoint, prompt))


@pytest.fixture(scope="module")
def mlx4(tiny_checkpoints):
    return checkpoint_of(tiny_checkpoints, "mlx4")


def test_chunked_prefill_equals_one_shot_across_kv_cache_growth(mlx4):
    """A prompt longer than the KV cache's first capacity, fed in uneven chunks (up to 8 tokens: GEMV; more: GEMM),
    gives the one-shot logits, and both match the reference."""
    backend = CpuBackend(mlx4)
    prompt = np.random.default_rng(3).integers(0, mlx4.args.vocab_size, KV_CACHE_MIN_CAPACITY + 49)
    one_shot = backend.forward(prompt, backend.new_state())
    state, parts, start = backend.new_state(), [], 0
    for size in (1, 3, 4, 17, 200, 5, 64, 2, 9):
        parts.append(backend.forward(prompt[start : start + size], state))
        start += size
    assert start == len(prompt) and state.position == len(prompt)
    chunked = np.concatenate(parts)
    assert relative_error(chunked, one_shot) < 1e-5
    want = ReferenceModel(mlx4).forward(prompt, ReferenceModel(mlx4).new_state())
    assert relative_error(one_shot, want) < LOGITS_TOLERANCE


@pytest.mark.parametrize("tokens", [2, 3, 4, 5, 6, 7, 8])
def test_a_few_tokens_equal_the_same_tokens_decoded_one_by_one(mlx4, tokens, isa):
    """Up to 8 tokens run the GEMV (on AVX2 every token shares each decoded weight row, in blocks of R rows x T
    tokens chosen by T): the same sums, in the same order, as one decode step per token, so the logits are
    bit-identical; and they match the reference."""
    backend = CpuBackend(mlx4)
    prompt = np.random.default_rng(tokens).integers(0, mlx4.args.vocab_size, tokens)
    together = backend.forward(prompt, backend.new_state())
    state = backend.new_state()
    one_by_one = np.concatenate([backend.forward(prompt[t : t + 1], state) for t in range(tokens)])
    np.testing.assert_array_equal(together, one_by_one)
    want = ReferenceModel(mlx4).forward(prompt, ReferenceModel(mlx4).new_state())
    assert relative_error(together, want) < LOGITS_TOLERANCE


@pytest.mark.skipif("avx512" not in ISAS, reason="needs a CPU with AVX-512F and AVX-512VL")
@pytest.mark.parametrize("layout", ["mlx4", "mlx4_f32_scales"])
def test_the_avx512_gemv_gives_the_avx2_gemvs_bits(tiny_checkpoints, layout):
    """`avx512` runs the GEMV's AVX2 loop with 32 registers, in other blockings (one pass over the rows for 5 to 8
    tokens): the same sums in the same order, so prompts of 1 to 8 tokens and the decode steps after them give the
    AVX2 loops' bits."""
    checkpoint = checkpoint_of(tiny_checkpoints, layout)
    backend = CpuBackend(checkpoint)
    rng = np.random.default_rng(11)
    try:
        for tokens in range(1, 9):
            prompt = rng.integers(0, checkpoint.args.vocab_size, tokens)
            runs = []
            for name in ("avx2", "avx512"):
                _ext.cpu.set_isa(name)
                state = backend.new_state()
                runs.append([backend.forward(prompt, state), backend.forward(prompt[-1:], state)])
            for got, want in zip(runs[1], runs[0]):
                np.testing.assert_array_equal(got, want)
    finally:
        _ext.cpu.set_isa(DEFAULT_ISA)


def test_profile_prefill_times_every_node_once_and_changes_no_result(mlx4, capsys):
    """lily bench --profile on the cpu backend: each node of the prefill timed on the host clock, once; the logits
    of a profiled prefill are the plain ones."""
    backend = CpuBackend(mlx4)
    prompt = np.random.default_rng(12).integers(0, mlx4.args.vocab_size, 8)
    assert backend.supports_profiling
    times = backend.profile_prefill(prompt)
    kernels = backend._engine.last_step_counts()["dispatches_by_kernel"]
    assert Counter(kernel for kernel, _, _ in times) == Counter(kernels)
    assert all(ms >= 0 for _, _, ms in times) and sum(ms for _, _, ms in times) > 0
    with pytest.raises(ValueError, match="at least 2 tokens"):
        backend.profile_prefill(prompt[:1])
    want = backend.forward(prompt, backend.new_state())
    backend._engine._engine.set_profiling(True)
    try:
        got = backend.forward(prompt, backend.new_state())
    finally:
        backend._engine._engine.set_profiling(False)
    np.testing.assert_array_equal(got, want)
    assert lily.cli.main(["bench", "--model", str(mlx4.path), "--backend", "cpu", "-p", "8", "-n", "1", "-r", "1",
                          "--profile"]) == 0
    out = capsys.readouterr().out
    assert "time of a 8-token prefill, node by node" in out and "`qmv_q4_g64_f32`" in out


def test_last_only_returns_the_last_row(mlx4):
    backend = CpuBackend(mlx4)
    prompt = np.random.default_rng(4).integers(0, mlx4.args.vocab_size, 13)
    full = backend.forward(prompt, backend.new_state())
    last = backend.forward(prompt, backend.new_state(), last_only=True)
    assert last.shape == (1, mlx4.args.vocab_size)
    # One row runs the decode GEMV, 13 rows the GEMM: the same sums, rounded in another order.
    assert relative_error(last[0], full[-1]) < 1e-6


def test_one_and_two_threads_give_identical_logits(mlx4):
    """Threads split rows, experts and heads, never a sum: the result does not depend on the thread count."""
    prompt = np.random.default_rng(5).integers(0, mlx4.args.vocab_size, 40)
    one, two = CpuBackend(mlx4, threads=1), CpuBackend(mlx4, threads=2)
    assert (one.threads, two.threads) == (1, 2)
    s1, s2 = one.new_state(), two.new_state()
    np.testing.assert_array_equal(one.forward(prompt, s1), two.forward(prompt, s2))
    np.testing.assert_array_equal(one.forward(prompt[:1], s1), two.forward(prompt[:1], s2))


@pytest.mark.parametrize("layout", ["mlx4", "mlx4_f32_scales", "hf_f32"])
def test_short_prompts_and_decode_steps_do_not_depend_on_the_thread_count(tiny_checkpoints, layout, isa):
    """Prompts of 1 to 8 tokens (the GEMV; the projections of one input as one job in a decode step; experts with 1
    to 8 tokens each) then decode steps, on 1, 2 and 3 threads: the pool splits rows, experts and heads, never a
    sum."""
    checkpoint = checkpoint_of(tiny_checkpoints, layout)
    backends = [CpuBackend(checkpoint, threads=n) for n in (1, 2, 3)]
    rng = np.random.default_rng(9)
    for tokens in range(1, 9):
        prompt = rng.integers(0, checkpoint.args.vocab_size, tokens)
        states = [b.new_state() for b in backends]
        outs = [b.forward(prompt, s) for b, s in zip(backends, states)]
        outs += [b.forward(prompt[:1], s) for b, s in zip(backends, states)]
        for got in outs[1:3]:
            np.testing.assert_array_equal(got, outs[0])
        for got in outs[4:]:
            np.testing.assert_array_equal(got, outs[3])


def test_a_bad_instruction_set_in_the_environment_is_refused_by_name(mlx4):
    """LILY_CPU_ISA is read when the extension loads; one it cannot take is refused when a cpu backend loads."""
    code = ("from lily.backends.cpu import CpuBackend\nfrom lily.checkpoint import load_checkpoint\n"
            f"CpuBackend(load_checkpoint({str(mlx4.path)!r}))")
    for value, message in (("neon", "LILY_CPU_ISA='neon': CPU instruction set must be 'avx512', 'avx2' or 'portable'"),
                           ("portable", None)):
        run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LILY_CPU_ISA": value},
                             capture_output=True, text=True, timeout=120)
        if message is None:
            assert run.returncode == 0, run.stderr[-2000:]
        else:
            assert run.returncode != 0 and f"ValueError: {message}" in run.stderr, run.stderr[-2000:]


def test_thread_count_comes_from_the_environment():
    assert default_threads({"LILY_NUM_THREADS": "3"}) == 3
    assert default_threads({}) >= 1
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="LILY_NUM_THREADS"):
            default_threads({"LILY_NUM_THREADS": bad})


def test_bad_inputs_are_refused_with_clear_errors(mlx4, tiny_checkpoints):
    backend = CpuBackend(mlx4)
    with pytest.raises(ValueError, match="token_ids must lie in"):
        backend.forward(np.array([mlx4.args.vocab_size]), backend.new_state())
    with pytest.raises(ValueError, match="non-empty"):
        backend.forward(np.array([], dtype=np.int64), backend.new_state())
    with pytest.raises(ValueError, match="new_state"):
        backend.forward(np.array([1]), ReferenceModel(mlx4).new_state().layers)
    other = CpuBackend(checkpoint_of(tiny_checkpoints, "mlx4", "gqa4"))
    with pytest.raises(ValueError, match="new_state"):
        backend.forward(np.array([1]), other.new_state())
    with pytest.raises(ValueError, match="threads"):
        CpuBackend(mlx4, threads=0)
    with pytest.raises(ValueError, match="isa|instruction set|avx2"):
        _ext.cpu.set_isa("neon")
    assert _ext.cpu.isa() == DEFAULT_ISA
    with pytest.raises(ValueError, match="float32 only"):
        lily.Model.load(mlx4.path, backend="cpu", precision="bfloat16")


def test_session_snapshot_save_and_load_continue_exactly(mlx4, tmp_path):
    model = lily.Model.load(mlx4.path, backend="cpu")
    assert model.backend_name == "cpu"
    prompt = np.random.default_rng(6).integers(0, mlx4.args.vocab_size, 20).tolist()
    greedy = dict(max_tokens=8, temperature=0, stop_token_ids=[])
    straight = model.generate(prompt, use_cache=False, **greedy).token_ids

    session = model.prefill(prompt[:12], use_cache=False)
    snapshot = session.snapshot()
    session.save(tmp_path / "s.safetensors")
    loaded = lily.Session.load(tmp_path / "s.safetensors", model)
    restored = model.new_session(use_cache=False)
    restored.restore(snapshot)
    for s in (session, loaded, restored):
        model.prefill(prompt[12:], session=s)
        assert [t.id for t in s.decode(**greedy)] == straight


def test_auto_picks_the_cpu_backend_off_a_mac():
    if sys.platform == "darwin":
        pytest.skip("a Mac runs the Metal engine (tests/engine)")
    assert lily.Model.load("lily:demo").backend_name == "cpu"
    assert lily.Model.load("lily:demo", backend="reference").backend_name == "reference"


def test_cli_generate_and_bench_run_on_the_cpu_backend_by_default(capsys):
    """The user path: `lily generate` and `lily bench` with no --backend go through auto -> cpu off a Mac."""
    from test_cli import run_cli

    if sys.platform == "darwin":
        pytest.skip("a Mac runs the Metal engine (tests/engine)")
    argv = ["generate", "ROMEO:", "--max-tokens", "8", "--temp", "0"]
    code, default_out, _ = run_cli(argv, capsys)
    assert code == 0 and default_out.strip()
    code, reference_out, _ = run_cli(argv + ["--backend", "reference"], capsys)
    assert code == 0 and default_out == reference_out
    code, out, _ = run_cli(["bench", "-p", "8", "-n", "4", "-r", "1"], capsys)
    assert code == 0 and re.search(r"\| cpu +\|", out), out


def test_demo_greedy_text_matches_the_reference():
    cpu = lily.Model.load("lily:demo", backend="cpu")
    ref = lily.Model.load("lily:demo", backend="reference")
    opts = dict(max_tokens=24, temperature=0)
    assert cpu.generate("ROMEO:", **opts).token_ids == ref.generate("ROMEO:", **opts).token_ids


def test_the_short_prompt_benchmark_prints_every_row_with_its_bar(capsys, monkeypatch):
    """scripts/bench_short_prompts.py (issue 22's measurement) runs on the cpu backend and prints its table."""
    from fixtures import load_script

    monkeypatch.setenv("LILY_NUM_THREADS", "2")
    assert load_script("scripts/bench_short_prompts.py").main(["--rounds", "5"]) == 0
    out = capsys.readouterr().out
    assert "backend cpu, 2 threads" in out
    for row in ("decode step (tg1)", "decode step (tg32 / 32)", "| pp1 |", "| pp2 |", "| pp4 |", "| pp8 |"):
        assert row in out, out
    assert "<= 1.2" in out and "<= 2.0" in out
