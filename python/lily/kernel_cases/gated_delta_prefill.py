"""Cases of metal/gated_delta_prefill.metal (the chunk's causal conv, the register-resident scan and its blockwise
ablation) against ``lily.reference``'s DeltaNet pieces."""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from lily.kernel_cases.common import REL_RMS, Case, Run, dtype_of, poisoned, to_f64
from lily.kernel_cases.gated_delta import gated_delta_args, gated_delta_expected, gated_delta_inputs

PATTERN = re.compile(r"gated_delta_(conv|prefill|prefill_blockwise)_(f32|f16|bf16)_dk(128|64)")


def _chunk(run: Run, kernel: str, tokens: int, hk: int, hv: int, dk: int, dv: int) -> None:
    dtype = dtype_of(kernel)
    inp = gated_delta_inputs(run.rng, dtype, hk, hv, dk, dv, tokens)
    y, mixed, state = gated_delta_expected(inp, dtype, hk, hv, dk, dv)
    args = gated_delta_args(tokens, hk, hv, dv)
    if "_conv_" in kernel:  # one thread per channel, fp32 [T, C] scratch
        conv_out = np.full(mixed.shape, np.nan, np.float32)
        run.dispatch(kernel, [args, inp["qkv"], inp["conv_weight"], inp["conv_state"], conv_out],
                     -(-mixed.shape[1] // 256), 256)
        run.compare("conv out", conv_out, mixed, REL_RMS["f32"])
        return
    out = poisoned((tokens, hv * dv), dtype)
    conv_out = np.ascontiguousarray(mixed, np.float32)
    run.dispatch(kernel, [args, conv_out, inp["z"], inp["b"], inp["a"], inp["a_log"], inp["dt_bias"],
                          inp["norm_weight"], inp["state"], out],
                 hv, 32 * dv // 8)  # one threadgroup per value head, 8 state rows per simdgroup
    run.compare("out", to_f64(out, dtype), y, REL_RMS[dtype])
    run.compare("state", inp["state"], state, REL_RMS["f32"])


def cases(kernel: str) -> list[Case]:
    """Every case of one DeltaNet prefill kernel: one key head with 2 value heads at dk = dv; the blockwise scan gets
    more tokens than its 16-token block, so its state makes a round trip through memory."""
    dk = int(re.search(r"_dk(\d+)$", kernel).group(1))
    tokens = 19 if "_blockwise_" in kernel else 4
    return [Case(kernel, f"T={tokens} Hk=1 Hv=2 dk={dk} dv={dk}",
                 partial(_chunk, kernel=kernel, tokens=tokens, hk=1, hv=2, dk=dk, dv=dk), quick=True)]
