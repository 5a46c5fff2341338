"""Cases of metal/gated_delta_prefill.metal (the chunk's causal conv, the register-resident scan and its blockwise
ablation, the chunked scan, the gated norm) against ``lily.reference.gated_delta``, ``causal_conv1d`` and
``gated_rms_norm``.

A scan case runs conv, scan and norm as the engine does. Chunks of 1, 2, 3, 4, 17 tokens continue from random conv
and recurrent states, or start empty in chunks of 2 + 3; dv 33 and 48 leave the last of a head's 32-row threadgroups
(LILY_GDN_PREFILL_ROWS_PER_THREADGROUP) with 1 and 16 rows and its last simdgroup's row slots partly empty; the
Dk = 64 instances run the demo model's layout. The blockwise instances (the REGISTER_SCAN ablation: the state
round-trips through memory every 16 tokens) run chunks shorter than, equal to and across the block, against the
reference and bit for bit against the register-resident scan. The chunked scan (gated_delta_chunk_prepare, then
gated_delta_chunk_scan, between the conv and the norm as the engine runs them; a case of either kernel runs both) runs
T = 1, C - 1, C, C + 1 and 2C + 3 tokens (C = 32), from random and empty states (also in two prefills), dv
16/24/48/64/128 (24: a threadgroup's second simdgroup without rows), mild decays that carry the state over 4C + 5
tokens, and extreme gates, against the delta rule in float64 and, within twice its allowance, the plain scan. The norm kernel alone runs on random fp32 rows with
a partial last threadgroup. Outputs and the fp32 scratches start NaN-poisoned.
"""

from __future__ import annotations

import math
import re
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import TOLERANCES, Case, Run, Tolerance, dtype_of, round_to, to_device, to_f64
from lily.kernel_cases.gated_delta import (CHUNK, EPS, F32_CHAIN, check_layer, chunk_scratch, make_layer, make_tokens,
                                           prefill_threads, run_chunk_scan, run_conv, run_prefill, run_prefill_norm,
                                           token_range)

PATTERN = re.compile(r"gated_delta_(conv|conv_state|prefill|prefill_blockwise|chunk_prepare|chunk_scan)"
                     r"_(f32|f16|bf16)_dk(128|64)|gated_delta_prefill_norm_(f32|f16|bf16)")
# (Hk, Hv, dv, tokens, extra simdgroups) of the register scan by Dk; the first is the self-test's. dv 33 and 48: a
# head's second threadgroup holds 1 and 16 of its 32 rows, at T = 1, 3 and 17. An extra simdgroup (one with no row)
# fits only below 32 rows per threadgroup (one row per simdgroup: 1024 threads at 32 rows).
PREFILL_SHAPES = {128: [(1, 2, 128, 4, 0), (2, 4, 32, 1, 0), (2, 4, 33, 3, 0), (2, 4, 24, 3, 1), (2, 4, 32, 17, 0),
                        (2, 4, 128, 2, 0), (2, 4, 48, 1, 0), (2, 4, 48, 17, 0), (2, 4, 20, 17, 1)],
                  64: [(1, 2, 64, 4, 0), (2, 4, 64, 1, 0), (2, 4, 24, 5, 1), (2, 6, 64, 17, 0), (2, 4, 48, 17, 0)]}
# (Hk, Hv, dv, tokens, extra simdgroups) of the blockwise scan: one token; a chunk shorter than the 16-token block;
# exactly one block; one token past it; two blocks and a partial third; dv 33 and 48 rows over uneven threadgroups
# and simdgroups.
BLOCKWISE_SHAPES = {128: [(1, 2, 128, 19, 0), (2, 4, 32, 1, 0), (2, 2, 33, 15, 0), (2, 2, 20, 15, 1),
                          (2, 4, 32, 16, 0), (2, 2, 32, 17, 0), (2, 2, 31, 33, 1), (2, 4, 48, 17, 0)],
                    64: [(1, 2, 64, 19, 0), (2, 4, 64, 17, 0), (2, 6, 33, 32, 0)]}
# (Hk, Hv, dv, tokens) of the chunked scan by Dk, around the C = 32-token chunk: two chunks and a partial third (the
# self-test's), one token, C - 1 (one partial chunk), C, C + 1; dv 16 (one threadgroup of two 8-row simdgroups), 24
# (a head's second threadgroup with one simdgroup of rows), 48; the model's dv = Dk = 128; Hv/Hk = 3 at Dk = 64.
CHUNK_SHAPES = {128: [(1, 2, 16, 2 * CHUNK + 3), (2, 4, 16, 1), (1, 2, 24, CHUNK - 1), (2, 4, 16, CHUNK),
                      (1, 2, 48, CHUNK + 1), (1, 2, 128, 2 * CHUNK + 3)],
                64: [(2, 4, 64, 2 * CHUNK + 3), (2, 4, 16, 1), (2, 6, 24, CHUNK - 1), (1, 2, 64, CHUNK),
                     (1, 2, 48, CHUNK + 1)]}
# The chunked scan orders the arithmetic differently from the token rule (and from the fp32 reference, which the
# plain scan follows step for step), so it is checked against the rule in float64 on the kernel's own conv output,
# with allowances in units of fp32 rounding (u = 2^-24) of the head's state scale (the largest RMS of its state over
# the chunk): o (before the norm) within O_ULPS u scale, the state within STATE_ULPS u scale; the allowance goes
# through the gated norm as its first-order sensitivity. Measured over these cases: o 30 u scale, the state 210; over
# the same shapes the chunked and the plain scan were equally close (o 22 and 23, state 257 and 271).
O_ULPS, STATE_ULPS = 128, 1024
# (Hv, dv, tokens, threads) of the norm alone: the self-test's; one token; 17 tokens of dv 48 with a partial last
# threadgroup (68 rows, 8 per group); one row per group; dv 33 at 3 rows per group; the model's head shape.
NORM_SHAPES = [(2, 128, 4, 256), (4, 48, 1, 256), (4, 48, 17, 256), (2, 33, 3, 32), (2, 33, 5, 96), (32, 128, 2, 256)]


def _chunk(run: Run, kernel: str, hk: int, hv: int, dv: int, num_tokens: int, extra: int) -> None:
    """conv + the scan over a chunk from random states; the blockwise scan also gives the register scan's bits."""
    dk = int(kernel.rsplit("_dk", 1)[1])
    layer = make_layer(run.rng, hk, hv, dv, dtype_of(kernel), dk=dk)
    start, registers = layer.copy(), layer.copy()
    tokens = make_tokens(run.rng, layer, num_tokens)
    blockwise = "_blockwise_" in kernel
    scan = "prefill_blockwise" if blockwise else "prefill"
    out = run_prefill(run, layer, tokens, prefill_threads(layer, extra), scan, seed=3)
    check_layer(run, layer, start, tokens, out)
    if blockwise:  # same arithmetic; the state only passes through memory between blocks, exact in fp32
        register_out = run_prefill(run, registers, tokens, prefill_threads(registers), seed=5)
        run.compare_exact("out == register scan (bits)", out, register_out)
        run.compare_exact("state == register scan (bits)", layer.state.view(np.uint32), registers.state.view(np.uint32))


def _chunks_from_empty(run: Run, kernel: str) -> None:
    """Sequence start (zero states), then a second chunk: chunks of 2 + 3 equal the reference over 5 tokens."""
    layer = make_layer(run.rng, 1, 2, 64, dtype_of(kernel), fresh=True)
    start = layer.copy()
    tokens = make_tokens(run.rng, layer, 5)
    outs = [run_prefill(run, layer, token_range(tokens, a, b), prefill_threads(layer)) for a, b in ((0, 2), (2, 5))]
    check_layer(run, layer, start, tokens, np.concatenate(outs))


def _scan_reference(layer, start, conv_out: np.ndarray, tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """lily.reference.gated_delta_rule in float64 over the inputs gated_delta does form from `conv_out` (the kernel's
    fp32 conv output), one token at a time: o [T, Hv, dv], the state [Hv, dv, Dk] (the kernel's layout) and each
    head's state scale, the largest RMS of its state over the chunk (start included) [Hv]."""
    t, key_dim, d = conv_out.shape[0], layer.hk * layer.dk, layer.dtype
    q = reference.l2_normalize(conv_out[:, :key_dim].reshape(t, layer.hk, layer.dk)) * np.float32(layer.dk**-0.5)
    k = reference.l2_normalize(conv_out[:, key_dim : 2 * key_dim].reshape(t, layer.hk, layer.dk))
    v = conv_out[:, 2 * key_dim :].reshape(t, layer.hv, layer.dv)
    beta = reference._sigmoid(to_f64(tokens["b"], d))
    g = -np.exp(layer.a_log) * reference._softplus(to_f64(tokens["a"], d).astype(np.float32) + layer.dt_bias)
    state = start.state.transpose(0, 2, 1).astype(np.float64)
    rms = lambda x: np.sqrt(np.mean(np.square(x), axis=(1, 2)))  # noqa: E731 per head
    scale, o = rms(state), []
    for i in range(t):
        o_i, state = reference.gated_delta_rule(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1],
                                                beta[i : i + 1], state, dtype=np.float64)
        o.append(o_i)
        scale = np.maximum(scale, rms(state))
    return np.concatenate(o), state.transpose(0, 2, 1), scale


def _check_chunked(run: Run, layer, start, tokens, conv_out: np.ndarray, core_out: np.ndarray, out: np.ndarray,
                   scratch: dict[str, np.ndarray], plain=None, plain_out: np.ndarray | None = None) -> None:
    """A chunked scan's results (`layer` after it from `start`): o, the normed out and the state against the float64
    rule within the O_ULPS/STATE_ULPS allowances; with `plain` (the layer after the plain scan from `start`), the
    out and the state against the plain scan's within twice those; every element of the prepare scratch written."""
    t, hv, dv, d = conv_out.shape[0], layer.hv, layer.dv, layer.dtype
    o, state, scale = _scan_reference(layer, start, conv_out, tokens)
    _, conv_state = reference.causal_conv1d(to_f64(tokens["qkv"], d), to_f64(start.conv_weight, d),
                                            to_f64(start.conv_state, d))
    run.compare_exact("conv state", to_f64(layer.conv_state, d), conv_state)
    o_allowance = np.broadcast_to((O_ULPS * 2.0**-24 * scale)[None, :, None], o.shape)
    run.compare("o", core_out.reshape(o.shape), o, TOLERANCES["f32"], o_allowance)
    # out = o r w SiLU(z), r = 1 / rms(o): |d out| <= |w SiLU(z)| r (|d o| + |o| r rms(d o)).
    z = to_f64(tokens["z"], d).reshape(o.shape)
    weight = to_f64(layer.norm_weight, d)
    expected = reference.gated_rms_norm(o, z, weight, EPS)
    r = 1.0 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + EPS)
    out_allowance = np.abs(weight * z / (1.0 + np.exp(-z))) * r * o_allowance * (1.0 + np.abs(o) * r)
    tolerance = F32_CHAIN if d == "f32" else TOLERANCES[d]
    run.compare("out", to_f64(out, d), round_to(expected, d).reshape(t, -1), tolerance, out_allowance.reshape(t, -1))
    state_tolerance = Tolerance(rtol=4e-6, atol=0.0, rel_rms=math.inf)
    state_allowance = (STATE_ULPS * 2.0**-24 * scale)[:, None, None]
    run.compare("state", layer.state, state, state_tolerance, state_allowance)
    if plain is not None:
        run.compare("out vs plain scan", to_f64(out, d), to_f64(plain_out, d), tolerance,
                    2 * out_allowance.reshape(t, -1))
        run.compare("state vs plain scan", layer.state, plain.state, state_tolerance, 2 * state_allowance)
    unwritten = [name for name, x in scratch.items() if np.isnan(x).any()]
    run.require("prepare scratch written", not unwritten, f"NaN left in {unwritten}")


def _chunked_run(run: Run, layer, tokens) -> None:
    """conv + chunked scan + norm, then the plain scan from the same start, checked by _check_chunked."""
    start = layer.copy()
    conv_out = run_conv(run, layer, tokens["qkv"], seed=2)
    scratch = chunk_scratch(layer, conv_out.shape[0])
    core_out = run_chunk_scan(run, layer, conv_out, tokens, scratch=scratch, seed=3)
    out = run_prefill_norm(run, layer, core_out, tokens["z"])
    plain = start.copy()
    plain_out = run_prefill(run, plain, tokens, prefill_threads(plain), seed=4)
    _check_chunked(run, layer, start, tokens, conv_out, core_out, out, scratch, plain, plain_out)


def _chunked(run: Run, kernel: str, hk: int, hv: int, dv: int, num_tokens: int, fresh: bool = False,
             mild: bool = False) -> None:
    """One chunk of the engine (random or empty states); `mild`: decays near 1 (a far below -dt_bias), so the state
    carries over every chunk instead of being forgotten within a few tokens."""
    dk = int(kernel.rsplit("_dk", 1)[1])
    layer = make_layer(run.rng, hk, hv, dv, dtype_of(kernel), dk=dk, fresh=fresh)
    tokens = make_tokens(run.rng, layer, num_tokens)
    if mild:
        tokens["a"] = to_device(-7.0 + run.rng.standard_normal((num_tokens, hv)), layer.dtype)
    _chunked_run(run, layer, tokens)


def _chunked_extreme_gates(run: Run, kernel: str) -> None:
    """Decay 0 and 1 and beta 0 and 1 (|a| = 40, |b| = 30) in patterns over C + 1 tokens, and zero keys (tokens 2 to
    5 with zero raw keys: token 5's conv window): finite and right."""
    dk = int(kernel.rsplit("_dk", 1)[1])
    layer = make_layer(run.rng, 1, 2, 16, dtype_of(kernel), dk=dk)
    t = CHUNK + 1
    tokens = make_tokens(run.rng, layer, t)
    a = np.array([40.0, -40.0, -40.0, 3.0])
    tokens["a"] = to_device(np.stack([np.resize(a, t), np.resize(a[::-1], t)], 1), layer.dtype)
    tokens["b"] = to_device(np.stack([np.resize([30.0, -30.0, 0.5], t), np.resize([-30.0, 30.0], t)], 1), layer.dtype)
    tokens["qkv"][2:6, dk : 2 * dk] = 0
    _chunked_run(run, layer, tokens)


def _chunked_from_empty(run: Run, kernel: str) -> None:
    """Sequence start (zero states) in two chunked prefills of C + 8 and C + 3 tokens, against the reference over all
    of them."""
    dk = int(kernel.rsplit("_dk", 1)[1])
    layer = make_layer(run.rng, 1, 2, 32, dtype_of(kernel), fresh=True, dk=dk)
    start = layer.copy()
    tokens = make_tokens(run.rng, layer, 2 * CHUNK + 11)
    conv_outs, core_outs, outs = [], [], []
    scratches = {}
    for i, (begin, end) in enumerate(((0, CHUNK + 8), (CHUNK + 8, 2 * CHUNK + 11))):
        part = token_range(tokens, begin, end)
        conv_outs.append(run_conv(run, layer, part["qkv"]))
        scratch = chunk_scratch(layer, end - begin)
        core_outs.append(run_chunk_scan(run, layer, conv_outs[-1], part, scratch=scratch))
        outs.append(run_prefill_norm(run, layer, core_outs[-1], part["z"]))
        scratches.update({f"{name} {i}": x for name, x in scratch.items()})
    _check_chunked(run, layer, start, tokens, np.concatenate(conv_outs), np.concatenate(core_outs),
                   np.concatenate(outs), scratches)


def _conv(run: Run, kernel: str, hk: int, hv: int, dv: int, num_tokens: int, threads: int) -> None:
    """The conv and conv-state kernels (run_conv): the fp32 output and the new conv state against
    reference.causal_conv1d. `kernel` is either of the two; both run."""
    dtype, dk = dtype_of(kernel), int(kernel.rsplit("_dk", 1)[1])
    layer = make_layer(run.rng, hk, hv, dv, dtype, dk=dk)
    tokens = make_tokens(run.rng, layer, num_tokens)
    expected, new_state = reference.causal_conv1d(to_f64(tokens["qkv"], dtype), to_f64(layer.conv_weight, dtype),
                                                  to_f64(layer.conv_state, dtype))
    conv_out = run_conv(run, layer, tokens["qkv"], threads)
    run.compare("conv + SiLU", conv_out, expected, "f32")
    run.compare_exact("conv state", to_f64(layer.conv_state, dtype), new_state)


def _norm(run: Run, kernel: str, hv: int, dv: int, num_tokens: int, threads: int) -> None:
    """The gated norm alone: random fp32 o rows (spread over four decades of scale) against
    reference.gated_rms_norm."""
    dtype = dtype_of(kernel)
    layer = make_layer(run.rng, 1, hv, dv, dtype, dk=64)
    scale = 10.0 ** run.rng.uniform(-2, 2, (num_tokens, hv, 1))
    core_out = np.ascontiguousarray((scale * run.rng.standard_normal((num_tokens, hv, dv))).reshape(num_tokens, -1),
                                    dtype=np.float32)
    z = make_tokens(run.rng, layer, num_tokens)["z"]
    out = run_prefill_norm(run, layer, core_out, z, threads)
    expected = reference.gated_rms_norm(core_out.reshape(num_tokens, hv, dv),
                                        to_f64(z, dtype).reshape(num_tokens, hv, dv), to_f64(layer.norm_weight, dtype),
                                        EPS).reshape(num_tokens, hv * dv)
    run.compare("out", to_f64(out, dtype), round_to(expected, dtype), F32_CHAIN if dtype == "f32" else dtype)


def cases(kernel: str) -> list[Case]:
    """Every case of one DeltaNet prefill kernel; the first is the self-test's."""
    if "_norm_" in kernel:
        return [Case(kernel, f"T={t} Hv={hv} dv={dv} threads={threads}",
                     partial(_norm, kernel=kernel, hv=hv, dv=dv, num_tokens=t, threads=threads), quick=i == 0)
                for i, (hv, dv, t, threads) in enumerate(NORM_SHAPES)]
    dk = int(kernel.rsplit("_dk", 1)[1])
    if "_conv_" in kernel:
        # T below, at and above the K - 1 = 3 inputs the state keeps, and across token blocks of 16 (33: three).
        found = [Case(kernel, f"T=4 Hk=1 Hv=2 dv={dk} threads=256",
                      partial(_conv, kernel=kernel, hk=1, hv=2, dv=dk, num_tokens=4, threads=256), quick=True)]
        found += [Case(kernel, f"T={t} Hk=1 Hv=2 dv={dk} threads=64",
                       partial(_conv, kernel=kernel, hk=1, hv=2, dv=dk, num_tokens=t, threads=64))
                  for t in (1, 2, 3, 17, 33)]
        if dk == 128:  # a partial last threadgroup
            found.append(Case(kernel, "T=6 Hk=1 Hv=2 dv=33 threads=96",
                              partial(_conv, kernel=kernel, hk=1, hv=2, dv=33, num_tokens=6, threads=96)))
        return found
    if "_chunk_" in kernel:
        found = [Case(kernel, f"T={t} Hk={hk} Hv={hv} dv={dv}",
                      partial(_chunked, kernel=kernel, hk=hk, hv=hv, dv=dv, num_tokens=t), quick=i == 0)
                 for i, (hk, hv, dv, t) in enumerate(CHUNK_SHAPES[dk])]
        found += [Case(kernel, f"T={2 * CHUNK + 3} Hk=1 Hv=2 dv=32 from-empty",
                       partial(_chunked, kernel=kernel, hk=1, hv=2, dv=32, num_tokens=2 * CHUNK + 3, fresh=True)),
                  Case(kernel, f"T={4 * CHUNK + 5} Hk=1 Hv=2 dv=16 mild-decay",
                       partial(_chunked, kernel=kernel, hk=1, hv=2, dv=16, num_tokens=4 * CHUNK + 5, mild=True)),
                  Case(kernel, f"T={CHUNK + 8}+{CHUNK + 3} Hk=1 Hv=2 dv=32 from-empty",
                       partial(_chunked_from_empty, kernel=kernel))]
        if dk == 128:
            found.append(Case(kernel, f"T={CHUNK + 1} Hk=1 Hv=2 dv=16 extreme-gates",
                              partial(_chunked_extreme_gates, kernel=kernel)))
        return found
    shapes = (BLOCKWISE_SHAPES if "_blockwise_" in kernel else PREFILL_SHAPES)[dk]
    found = [Case(kernel, f"T={t} Hk={hk} Hv={hv} dv={dv} extra-simdgroups={x}",
                  partial(_chunk, kernel=kernel, hk=hk, hv=hv, dv=dv, num_tokens=t, extra=x), quick=i == 0)
             for i, (hk, hv, dv, t, x) in enumerate(shapes)]
    if "_blockwise_" not in kernel and dk == 128:
        found.append(Case(kernel, "T=2+3 Hk=1 Hv=2 dv=64 from-empty", partial(_chunks_from_empty, kernel=kernel)))
    return found
