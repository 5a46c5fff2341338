"""The EARLY_MOE_DOWN switch: on, a decode step's staged expert down kernel (the CUDA runtime) routes again from the
router's logits and issues its first weights and residual before its dependency wait (`moe_down_combine_staged_*`,
which the runtime may start while the gate/up kernel still runs); off, it waits first and reads the ids and weights the
gate/up kernel wrote (`moe_down_combine_staged_late_*`). The routing is the gate/up writer's code, so both choose the
same experts with the same weights: the same tokens and the same logits bits, checked through `decode_tokens` on the
fake libcuda, with the graph's early-start rule (tests/engine/test_early_start.py) on both."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env
from lily.sampling import SamplingParams

from tests.engine.test_early_start import check_graph
from tests.engine.test_fusion import PROMPT, checkpoints  # noqa: F401 (the fixture)

STEPS = 6


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_early_moe_down_gives_the_waiting_kernels_bits(checkpoints, cuda_engine_backend, precision):  # noqa: F811
    runs = {}
    for early in (True, False):
        backend = cuda_engine_backend(checkpoints["mlx"], precision=precision, switches={"early_moe_down": early})
        state = backend.new_state()
        last = backend.forward(PROMPT, state)[-1]
        tokens = list(backend.decode_tokens(state, last, SamplingParams(temperature=0.0), max_tokens=STEPS))
        runs[early] = tokens, backend.last_logits(state)
        nodes = check_graph(backend.last_step_graph())
        downs = [n for n in nodes if n["kernel"].startswith("moe_down_combine")]
        late = "late_" if not early else ""
        assert downs and all(n["kernel"].startswith(f"moe_down_combine_staged_{late}") for n in downs), downs
        # Early, it reads the router's output, its weights and the residual before its wait and starts behind the
        # gate/up kernel; late, nothing before its wait.
        assert all(bool(n["early_reads"]) == early and n["early_start"] for n in downs)
    assert runs[True][0] == runs[False][0]
    assert np.array_equal(runs[True][1].view(np.uint32), runs[False][1].view(np.uint32))


def test_early_moe_down_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_EARLY_MOE_DOWN": "1"}) == {"early_moe_down": False}
