"""One kernel library per op family (metal/<family>.metal): a family that does not compile disables only its own
kernels, names its file, line and Metal's diagnostic, and `python -m lily.selftest` lists it.

The fake Metal refuses a source with an unconditional #error, as Apple's compiler refuses a bad kernel; each family's
library holds only the harness kernels of its own file.
"""

from __future__ import annotations

import json
import re

import pytest

from lily import Model, selftest
from lily._ext import kernels

BROKEN = "rms_norm"


def broken_source(family: str) -> tuple[str, int]:
    """The embedded source of `family` with an #error on line 3 of its .metal file; returns (source, that line)."""
    source = kernels.family_sources()[family]
    marker = f'#line 1 "metal/{family}.metal"\n'
    head, body = source.split(marker)
    lines = body.split("\n")
    lines.insert(2, "#error deliberately broken for the library split test")
    return head + marker + "\n".join(lines), 3


def test_every_kernel_file_is_its_own_family() -> None:
    from pathlib import Path

    files = {p.stem for p in (Path(__file__).resolve().parents[2] / "metal").glob("*.metal")}
    families = kernels.family_sources()
    assert {name for name in families if "." not in name} == files
    # The Metal 4 tensor-op kernels get a library of their own, built only where the device supports them.
    assert {name for name in families if name.endswith(".tensor_ops")} == {"qmatmul.tensor_ops"}


@pytest.mark.metal
def test_a_broken_family_is_reported_and_the_other_families_still_run(monkeypatch, capfd) -> None:
    source, line = broken_source(BROKEN)
    runner = kernels.Runner(family_sources={BROKEN: source})
    (failure,) = runner.library_failures()
    assert failure["family"] == BROKEN and failure["file"] == f"metal/{BROKEN}.metal"
    assert f"metal/{BROKEN}.metal:{line}: error: deliberately broken" in failure["diagnostic"]
    assert "rms_norm_f32" in failure["kernels"] and all(k.startswith("rms_norm") for k in failure["kernels"])
    err = capfd.readouterr().err
    assert f"kernel family '{BROKEN}' (metal/{BROKEN}.metal) did not compile" in err

    # Running one of its kernels names the family and Metal's diagnostic.
    with pytest.raises(RuntimeError, match=rf"family '{BROKEN}' \(metal/{BROKEN}.metal\) did not compile.*:{line}:"):
        runner.run("rms_norm_f32", [b"\0" * 16], (1, 1, 1), (32, 1, 1))

    # The self-test lists the family; its kernels fail, other families' kernels pass against the reference.
    monkeypatch.setattr(selftest.device, "_metal_runner", lambda: runner)
    pattern = r"^(rms_norm_f32|rms_norm_residual_bf16|embedding_|dequantize_|attention_prep_f32_d64|argmax)"
    assert selftest.main(["--json", "--device", "metal-api", "--kernels", pattern]) == 1
    out, err = capfd.readouterr()
    rows = json.loads(out)
    assert f"kernel family '{BROKEN}' (metal/{BROKEN}.metal) did not compile" in err
    assert f"metal/{BROKEN}.metal:{line}: error: deliberately broken" in err
    failed = {r["kernel"] for r in rows if not r["passed"]}
    assert failed == {"rms_norm_f32", "rms_norm_residual_bf16"}
    others = [r["kernel"] for r in rows if r["passed"]]
    assert len(others) >= 4 and not any(k.startswith("rms_norm") for k in others)
    assert {re.match(r"[a-z]+", k).group(0) for k in others} >= {"embedding", "dequantize", "attention"}


@pytest.mark.metal
def test_the_engine_names_a_broken_family_it_needs(monkeypatch, capfd) -> None:
    from lily import _ext

    source, line = broken_source(BROKEN)
    engine_class = _ext.Engine

    def engine_with_broken_family(*args, **kwargs):
        return engine_class(*args, family_sources={BROKEN: source}, **kwargs)

    monkeypatch.setattr(_ext, "Engine", engine_with_broken_family)
    with pytest.raises((ValueError, RuntimeError)) as raised:
        model = Model.load("lily:demo", backend="metal", precision="float32", progress=False)
        model.generate("KING HENRY:", max_tokens=2, temperature=0)
    message = str(raised.value)
    assert f"family '{BROKEN}' (metal/{BROKEN}.metal) did not compile" in message
    assert f"metal/{BROKEN}.metal:{line}: error: deliberately broken" in message
    assert f"kernel family '{BROKEN}'" in capfd.readouterr().err


def test_an_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown kernel family 'no_such_family'"):
        kernels.Runner(family_sources={"no_such_family": "#error"})
