"""metal/gated_delta.metal (the decode step): every case of lily.kernel_cases.gated_delta (two steps from random
states at Dk 128 and 64, head ratios 1 to 4, rows uneven over simdgroups, extreme gates) against
lily.reference.gated_delta, then what the cases do not cover: the bits independent of the fiber schedule, and the
model-size layer (Hk 16, Hv 32, C 8192) through a decode step and a prefill chunk.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases

from lily.kernel_cases.common import Run
from lily.kernel_cases.gated_delta import (check_layer, make_layer, make_tokens, prefill_threads, run_prefill,
                                           run_step, token_range)


@pytest.mark.parametrize("case", op_cases("gated_delta"))
def test_gated_delta(case, kernel_device) -> None:
    check(case, kernel_device)


@pytest.mark.parametrize("seed", [1, 2])
def test_gated_delta_step_independent_of_schedule(seed: int, kernel_device) -> None:
    run = Run(kernel_device, np.random.default_rng(8))
    base = make_layer(run.rng, 1, 2, 32, "f32")
    tokens = make_tokens(run.rng, base, 1)
    results = []
    for random_schedule in (False, True):
        layer = base.copy()
        out = run_step(run, layer, tokens, 96, random_schedule=random_schedule, seed=seed)
        results.append((out, layer.state))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


def test_model_size_layer_bf16(kernel_device) -> None:
    """The real layer shape (Hk 16, Hv 32, dk = dv = 128, C = 8192): one decode step, then a 2-token prefill chunk."""
    run = Run(kernel_device, np.random.default_rng(2026))
    layer = make_layer(run.rng, 16, 32, 128, "bf16")
    start = layer.copy()
    tokens = make_tokens(run.rng, layer, 3)
    first = run_step(run, layer, token_range(tokens, 0, 1), 1024)
    rest = run_prefill(run, layer, token_range(tokens, 1, 3), prefill_threads(layer))
    check_layer(run, layer, start, tokens, np.concatenate([first, rest]))
    assert all(c.passed for c in run.comparisons), [c for c in run.comparisons if not c.passed]
