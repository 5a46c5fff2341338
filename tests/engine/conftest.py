"""The engine's runtimes as a test parameter: `engine_backend` is MetalBackend (the fake Metal on Linux, a Mac's GPU)
or CudaBackend (the fake libcuda on Linux, LILY_LIBCUDA; a real NVIDIA GPU with LILY_ENGINE_RUNTIMES=cuda), so one
test checks both runtimes under the same graphs (docs/engine.md, "Runtimes")."""

from __future__ import annotations

import os

import pytest

from tests.engine.runtimes import cuda_absent, prepare_cuda

# Which runtimes to run: all of them by default; LILY_ENGINE_RUNTIMES=cuda on a GPU machine without Metal.
RUNTIMES = os.environ.get("LILY_ENGINE_RUNTIMES", "metal,cuda").split(",")


def _params():
    # metal: skipped where this build has no Metal runtime (tests/conftest.py); cuda: where there is neither a driver
    # nor the fake libcuda (the fixture says so).
    marks = {"metal": [pytest.mark.metal], "cuda": []}
    return [pytest.param(name, marks=marks[name], id=name) for name in RUNTIMES]


def _prepared_cuda(request) -> str:
    absent = cuda_absent()
    if absent:  # no NVIDIA driver and a build without the fake libcuda (a Mac, a g++ build off the GPU machine)
        pytest.skip(absent)
    prepare_cuda(request)
    return "cuda"


@pytest.fixture(params=_params())
def engine_runtime(request) -> str:
    """The backend name of one runtime of the engine ("metal" or "cuda"), ready to load."""
    return _prepared_cuda(request) if request.param == "cuda" else "metal"


@pytest.fixture
def engine_backend(engine_runtime):
    """The backend class of one runtime, taking MetalBackend's arguments."""
    if engine_runtime == "cuda":
        from lily.backends.cuda import CudaBackend

        return CudaBackend
    from lily.backends.metal import MetalBackend

    return MetalBackend


@pytest.fixture
def cuda_engine_backend(request):
    """CudaBackend, for tests of the CUDA runtime alone."""
    _prepared_cuda(request)
    from lily.backends.cuda import CudaBackend

    return CudaBackend
