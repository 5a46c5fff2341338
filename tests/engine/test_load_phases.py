"""What a GPU backend's load shows: its phases (kernels and device, weights, buffers and graph) timed at debug level,
and a progress bar only where stderr is a terminal. Runs on each runtime (`engine_runtime`)."""

from __future__ import annotations

import logging
import re

import pytest

from lily import Model

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)


def test_load_phases_are_timed_at_debug_level_and_drawn_only_on_a_terminal(engine_runtime, caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="lily.backends.engine"):
        model = Model.load("lily:demo", backend=engine_runtime, progress=True)
    (line,) = [r.getMessage() for r in caplog.records if ": loaded in " in r.getMessage()]
    match = re.fullmatch(r".*: loaded in ([\d.]+) s \(kernels and device ([\d.]+) s, weights ([\d.]+) s, "
                         r"buffers and graph ([\d.]+) s\)", line)
    assert match, line
    total, *phases = map(float, match.groups())
    # Milliseconds printed: the demo can load in under 5 ms on the test runtime, so no phase need be above 0.
    assert total == pytest.approx(sum(phases), abs=0.002) and min(phases) >= 0
    # The test's stderr is no terminal: the bar draws nothing there.
    assert capsys.readouterr().err == "" and model.backend.device_memory()["weights"] > 0
