"""backend="cuda" from the user's side: choosing it, its errors, and `lily.Model` (prefill, the GPU token path, the
prompt cache) on the engine's CUDA runtime, against the reference backend. The engine's numbers on both runtimes are
tests/engine/test_metal_backend.py's (`engine_backend`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily import Model
from lily.backends import choose
from tests.engine.runtimes import cuda_absent, fake_libcuda, prepare_cuda
from tests.engine.test_metal_backend import PROMPT, save_checkpoints


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    prepared = os.environ.get("LILY_ENGINE_CHECKPOINTS")  # made elsewhere for a GPU machine without mlx-lm
    if prepared:
        return Path(prepared) / "mlx"
    root = tmp_path_factory.mktemp("cuda_backend")
    save_checkpoints(root)
    return root / "mlx"


def test_backend_cuda_without_a_driver_or_kernels_is_one_clear_error(monkeypatch, tmp_path, request):
    # No driver: a fresh process (the engine opens its driver once per process), $LILY_LIBCUDA naming no file.
    code = "from lily.backends import choose; choose('cuda')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LILY_LIBCUDA": str(tmp_path / "libcuda.so.1")})
    assert run.returncode != 0
    assert f"backend='cuda' is unavailable: no NVIDIA driver: {tmp_path / 'libcuda.so.1'} cannot be loaded" in \
        run.stderr, run.stderr
    # A driver but no kernels: the PTX folder is named.
    if cuda_absent():
        pytest.skip(cuda_absent())
    prepare_cuda(request)
    monkeypatch.setenv("LILY_CUDA_PTX_DIR", str(tmp_path))  # no .ptx there
    with pytest.raises(RuntimeError, match=rf"no CUDA kernels: no \.ptx files in {tmp_path} \(build them with "
                       r"`python -m lily.selftest --device cuda --compile-only --ptx-out DIR`"):
        choose("cuda")


def test_auto_looks_for_the_machines_own_driver(monkeypatch):
    # $LILY_LIBCUDA (the fake, in tests) is for backend="cuda" only: "auto" never picks a stand-in driver.
    fake = fake_libcuda()
    if fake is None:
        pytest.skip("this build has no fake libcuda (Linux builds with clang-19 have one)")
    monkeypatch.setenv("LILY_LIBCUDA", str(fake))
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has an NVIDIA driver: auto rightly picks cuda")
    except OSError:
        pass
    assert choose("auto") == "cpu"


def test_model_on_cuda_decodes_as_the_reference(cuda_engine_backend, checkpoint_dir):
    # Model.load -> CudaBackend; greedy decode through Session.decode (tokens chosen on the GPU, steps in flight),
    # then the prompt cache: the same prompt plus two tokens restores the cached snapshot and runs only the rest.
    cuda = Model.load(checkpoint_dir, backend="cuda", precision="float32")
    reference = Model.load(checkpoint_dir, backend="reference")
    assert type(cuda.backend).__name__ == "CudaBackend"
    prompt = [int(t) for t in PROMPT]
    want = [t.id for t in reference.prefill(prompt).decode(max_tokens=12, temperature=0)]
    got = [t.id for t in cuda.prefill(prompt).decode(max_tokens=12, temperature=0)]
    assert got == want
    # The penalized choice (penalize_logits and count_token in the CUDA graph) against the reference's CPU sampler.
    penalties = dict(max_tokens=12, temperature=0, presence_penalty=2.0, repetition_penalty=1.3,
                     logit_bias={want[0]: -50.0})
    want_penalized = [t.id for t in reference.prefill(prompt).decode(**penalties)]
    assert [t.id for t in cuda.prefill(prompt).decode(**penalties)] == want_penalized != want
    longer = prompt + want[:2]
    session = cuda.prefill(longer)
    assert session.stats.cached_tokens >= len(prompt)
    np.testing.assert_allclose(session.logits, reference.prefill(longer).logits, rtol=0,
                               atol=1e-3 * float(np.max(np.abs(session.logits))))
