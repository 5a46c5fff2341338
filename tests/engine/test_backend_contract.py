"""The backend contract (`lily.backends.Backend` and its capabilities): every backend is a `Backend`, each declares
exactly the capabilities `lily.Model` and `lily bench` use it for, and no backend module imports another's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lily.backends as backends
from lily.backends.cpu import CpuBackend
from lily.backends.cuda import CudaBackend
from lily.backends.engine import EngineBackend
from lily.backends.metal import MetalBackend
from lily.checkpoint import load_checkpoint
from lily.reference import ReferenceModel

from tests.engine.test_metal_head_dims import DEMO

pytestmark = pytest.mark.metal  # builds a metal backend (tests/conftest.py)

CAPABILITIES = (backends.GpuDecoding, backends.LiveSequence, backends.DeviceMemoryReport, backends.ExpertCounts,
                backends.KernelProfiling)


def capabilities(backend) -> set[str]:
    return {c.__name__ for c in CAPABILITIES if isinstance(backend, c)}


def test_every_backend_is_a_backend_with_its_capabilities():
    checkpoint = load_checkpoint(DEMO)
    engine = MetalBackend.synthetic(checkpoint.args)
    found = {name: backend for name, backend in (("reference", ReferenceModel(checkpoint)),
                                                 ("cpu", CpuBackend(checkpoint)), ("engine", engine))}
    assert all(isinstance(b, backends.Backend) for b in found.values())
    assert capabilities(found["reference"]) == set()
    assert capabilities(found["cpu"]) == {"ExpertCounts", "KernelProfiling"}
    assert capabilities(engine) == {"GpuDecoding", "LiveSequence", "DeviceMemoryReport", "KernelProfiling"}
    # The checks can fail: an object with only part of a protocol is not that capability.
    class HalfDecoder:
        def decode_tokens(self, *args, **kwargs):
            return iter(())
    assert not isinstance(HalfDecoder(), backends.GpuDecoding) and not isinstance(HalfDecoder(), backends.Backend)


def test_the_gpu_backends_share_the_engine_and_not_each_other():
    assert issubclass(MetalBackend, EngineBackend) and issubclass(CudaBackend, EngineBackend)
    assert not issubclass(CudaBackend, MetalBackend) and not issubclass(MetalBackend, CudaBackend)
    folder = Path(backends.__file__).parent
    modules = {path.stem for path in folder.glob("*.py")} - {"__init__", "engine"}
    for path in folder.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lily.backends."):
                imported.add(node.module.split(".")[2])
            if isinstance(node, ast.ImportFrom) and node.module == "lily.backends":
                imported |= {alias.name for alias in node.names}
        others = (imported & modules) - {path.stem}
        assert path.stem == "__init__" or not others, f"{path.name} imports {sorted(others)}"
