"""Cases of metal/gated_delta_prefill.metal (the chunk's causal conv, the register-resident scan and its blockwise
ablation, the gated norm) against ``lily.reference.gated_delta``, ``causal_conv1d`` and ``gated_rms_norm``.

A scan case runs conv, scan and norm as the engine does. Chunks of 1, 2, 3, 4, 17 tokens continue from random conv
and recurrent states, or start empty in chunks of 2 + 3; dv 33 and 48 leave the last of a head's 32-row threadgroups
(LILY_GDN_PREFILL_ROWS_PER_THREADGROUP) with 1 and 16 rows and its last simdgroup's row slots partly empty; the
Dk = 64 instances run the demo model's layout. The blockwise instances (the REGISTER_SCAN ablation: the state
round-trips through memory every 16 tokens) run chunks shorter than, equal to and across the block, against the
reference and bit for bit against the register-resident scan. The norm kernel alone runs on random fp32 rows with
a partial last threadgroup. Outputs and the fp32 scratches start NaN-poisoned.
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import Case, Run, dtype_of, round_to, to_f64
from lily.kernel_cases.gated_delta import (EPS, F32_CHAIN, check_layer, make_layer, make_tokens, prefill_threads,
                                           run_conv, run_prefill, run_prefill_norm, token_range)

PATTERN = re.compile(r"gated_delta_(conv|conv_state|prefill|prefill_blockwise)_(f32|f16|bf16)_dk(128|64)"
                     r"|gated_delta_prefill_norm_(f32|f16|bf16)")
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
    shapes = (BLOCKWISE_SHAPES if "_blockwise_" in kernel else PREFILL_SHAPES)[dk]
    found = [Case(kernel, f"T={t} Hk={hk} Hv={hv} dv={dv} extra-simdgroups={x}",
                  partial(_chunk, kernel=kernel, hk=hk, hv=hv, dv=dv, num_tokens=t, extra=x), quick=i == 0)
             for i, (hk, hv, dv, t, x) in enumerate(shapes)]
    if "_blockwise_" not in kernel and dk == 128:
        found.append(Case(kernel, "T=2+3 Hk=1 Hv=2 dv=64 from-empty", partial(_chunks_from_empty, kernel=kernel)))
    return found
