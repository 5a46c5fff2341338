"""The CUDA driver layer (src/lily_ext/cuda/driver.cpp) under lily.cuda. In CI, without a GPU, it runs on the fake
libcuda (src/test_doubles/cuda_fake/, loaded through $LILY_LIBCUDA), which runs the PTX's kernels on the CPU harness and runs graph
nodes in a seeded random order that respects only the declared edges (docs/cuda.md); the PTX is the session's one
CUDA build (the ``cuda_compile_only`` fixture, tests/conftest.py). With LILY_CUDA_TESTS=gpu the same tests, except
the fake's own, run on the real driver and GPU 0 with the packaged PTX or $LILY_CUDA_PTX_DIR (docs/verification.md).
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily import _ext, cuda

ROOT = Path(__file__).resolve().parents[1]
ON_GPU = os.environ.get("LILY_CUDA_TESTS") == "gpu"
FAKE_LIBCUDA = Path(_ext.__file__).resolve().parent / "liblily_fake_cuda.so"
FAKE_DEVICE = "Lily fake CUDA device (CPU harness)"
HAS_HARNESS = getattr(_ext, "msl", None) is not None
# A representative subset of the kernel tests (norms, quantized matmuls, MoE, attention, sampling); the Metal 4
# tensor-op kernels have no CUDA build, and the sampling distribution test is the slow one (10 s on the harness).
KERNEL_TESTS = ["test_rms_norm.py", "test_qmatmul.py", "test_moe.py", "test_attention.py", "test_sampling.py"]
KERNEL_TEST_FILTER = "not qmm_nax and not test_sample_distribution"
EPS = 1e-6

fake_only = pytest.mark.skipif(ON_GPU, reason="runs on the fake libcuda; on a GPU the kernel tests run themselves")


@pytest.fixture(scope="module")
def ptx(request) -> Path:
    if ON_GPU:
        return cuda.ptx_dir()
    if not HAS_HARNESS:
        pytest.skip("the fake libcuda is built with the CPU harness only (clang-19 on x86-64)")
    code, _, folder = request.getfixturevalue("cuda_compile_only")
    assert code == 0, "the CUDA build of the kernels failed (see test_cuda_build.py)"
    return folder


@pytest.fixture(scope="module")
def runner(ptx: Path) -> cuda.Runner:
    """A Runner on the fake libcuda, or on GPU 0 with LILY_CUDA_TESTS=gpu. The driver is opened once per process:
    this module sets $LILY_LIBCUDA before anything else in CI opens one."""
    if ON_GPU:
        return cuda.Runner(ptx)
    assert FAKE_LIBCUDA.is_file(), f"{FAKE_LIBCUDA} is not built (CMakeLists.txt builds it with the harness)"
    before = os.environ.get("LILY_LIBCUDA")
    os.environ["LILY_LIBCUDA"] = str(FAKE_LIBCUDA)
    try:
        r = cuda.Runner(ptx)
    finally:  # read once, when the driver is opened: later tests' subprocesses get the environment they had
        if before is None:
            del os.environ["LILY_LIBCUDA"]
        else:
            os.environ["LILY_LIBCUDA"] = before
    assert r.device_name == FAKE_DEVICE, f"this process already uses the CUDA driver of '{r.device_name}'"
    return r


def _fake_env(ptx: Path) -> dict[str, str]:
    return {**os.environ, "LILY_LIBCUDA": str(FAKE_LIBCUDA), "LILY_CUDA_PTX_DIR": str(ptx),
            "LILY_KERNEL_DEVICE": "cuda"}


@fake_only
def test_kernel_tests_pass_through_the_driver_layer_on_the_fake(ptx: Path) -> None:
    """LILY_KERNEL_DEVICE=cuda kernel tests: every dispatch goes lily.cuda -> driver.cpp -> the fake -> the harness,
    with the arguments packed into the Params block a GPU gets, and matches the float64 references."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", KERNEL_TEST_FILTER,
           *[str(ROOT / "tests" / "kernels" / name) for name in KERNEL_TESTS]]
    run = subprocess.run(cmd, cwd=ROOT, env=_fake_env(ptx), capture_output=True, text=True, timeout=900)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 300, summary
    assert not re.search(r"failed|skipped|error", summary), summary


@fake_only
def test_selftest_runs_on_the_fake(ptx: Path) -> None:
    code = "from lily import selftest\nraise SystemExit(selftest.main(['--device', 'cuda', '--kernels', '^rms_norm']))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_fake_env(ptx), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"Kernels ran on the NVIDIA GPU '{FAKE_DEVICE}' through the CUDA driver API." in run.stdout
    assert re.search(r"(\d+)/\1 kernels passed", run.stdout), run.stdout[-2000:]


def test_bad_arguments_are_refused_before_launch(runner: cuda.Runner) -> None:
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"rms_norm_f32 parameter 0 \[\[buffer\(0\)\]\] expects 16 bytes"):
        runner.dispatch("rms_norm_f32", [b"\0" * 8, x, x[0].copy(), x.copy()], (2, 1, 1), (64, 1, 1))
    with pytest.raises(ValueError, match=r"\[\[buffer\(3\)\]\] is not bound: only 3 args"):
        runner.dispatch("rms_norm_f32", [_args(64), x, x[0].copy()], (2, 1, 1), (64, 1, 1))
    with pytest.raises(ValueError, match=r"no kernel named 'rms_norm_f64'"):
        runner.launch("rms_norm_f64", [], (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match=r"bad launch shape threadgroups=\[1, 1, 1\] threads=\[2048, 1, 1\]"):
        runner.launch("rms_norm_f32", [], (1, 1, 1), (2048, 1, 1))


@fake_only
def test_a_kernel_fault_names_the_kernel_and_the_fakes_finding(runner: cuda.Runner) -> None:
    """A launch whose [[buffer(i)]] is not device memory fails in the driver call, naming the kernel and the slot."""
    out = runner.alloc(256)
    with pytest.raises(cuda.CudaError, match=r"kernel rms_norm_f32: cuLaunchKernel failed: CUDA_ERROR_ILLEGAL_ADDRESS"
                                             r".*\[\[buffer\(1\)\]\] is not device memory \(null\)"):
        runner.launch("rms_norm_f32", [out, 0, out, out], (1, 1, 1), (32, 1, 1))
    runner.free(out)


def test_packaged_ptx_is_beside_the_extension(monkeypatch) -> None:
    """Where the build installs the PTX (lily/cuda_kernels/, CMakeLists.txt), unless $LILY_CUDA_PTX_DIR says."""
    monkeypatch.delenv("LILY_CUDA_PTX_DIR", raising=False)
    assert Path(_ext.cuda.default_ptx_dir()).resolve() == Path(_ext.__file__).resolve().parent / "cuda_kernels"
    assert cuda.ptx_dir() == Path(_ext.cuda.default_ptx_dir())
    monkeypatch.setenv("LILY_CUDA_PTX_DIR", "/somewhere/ptx")
    assert _ext.cuda.default_ptx_dir() == "/somewhere/ptx" and cuda.ptx_dir() == Path("/somewhere/ptx")


def test_every_ptx_entry_is_a_kernel_by_its_name(runner: cuda.Runner, ptx: Path) -> None:
    """The driver's PTX scan (driver_abi.h) finds exactly the .entry names a regular expression finds here."""
    entry = re.compile(r"^(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z0-9_$]+)\s*\(", re.MULTILINE)
    expected = {name for path in ptx.glob("*.ptx") for name in entry.findall(path.read_text())}
    assert len(expected) > 100 and sorted(runner.kernel_names()) == sorted(expected)


def test_missing_ptx_is_a_clear_error(runner: cuda.Runner, tmp_path: Path) -> None:
    with pytest.raises(cuda.CudaError, match="no .ptx files in"):
        cuda.Runner(tmp_path)


# ---- Explicit graphs: y = rms_norm(x, w1); z = rms_norm(y, w2), with y poisoned (NaN) first; z copied out ----


def _args(n: int) -> bytes:
    """lily::RmsNormArgs (metal/lily.h)."""
    return struct.pack("<IfII", n, EPS, 0, 0)


def _rms_norm(h: np.ndarray, w: np.ndarray) -> np.ndarray:
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w


class _Chain:
    """A fill, two dependent kernels and a copy in one graph; `edge`: whether the second kernel declares the first."""

    rows, n = 3, 256

    def __init__(self, runner: cuda.Runner, edge: bool) -> None:
        rng = np.random.default_rng(7)
        self.x = (rng.standard_normal((self.rows, self.n)) * 3).astype(np.float32)
        self.w1, self.w2 = (1 + 0.5 * rng.standard_normal((2, self.n))).astype(np.float32)
        y = _rms_norm(self.x.astype(np.float64), self.w1.astype(np.float64)).astype(np.float32)
        self.expected = _rms_norm(y.astype(np.float64), self.w2.astype(np.float64))
        self.runner = runner
        self.buffers = {}
        for name, data in (("args", np.frombuffer(_args(self.n), np.uint8)), ("x", self.x), ("w1", self.w1),
                           ("w2", self.w2), ("y", self.x), ("z", self.x), ("out", self.x)):
            self.buffers[name] = runner.alloc(data.nbytes)
            runner.upload(self.buffers[name], data)
        b = self.buffers
        graph = runner.graph()
        poison = graph.add_fill(b["y"], 0xFF, self.x.nbytes)
        first = graph.add_kernel("rms_norm_f32", [b["args"], b["x"], b["w1"], b["y"]], (self.rows, 1, 1),
                                 (256, 1, 1), dependencies=[poison])
        second = graph.add_kernel("rms_norm_f32", [b["args"], b["y"], b["w2"], b["z"]], (self.rows, 1, 1),
                                  (256, 1, 1), dependencies=[first] if edge else [poison])
        graph.add_copy(b["out"], b["z"], self.x.nbytes, dependencies=[second])
        self.graph, self.exec = graph, graph.instantiate()

    def launch_is_right(self) -> bool:
        self.exec.launch()
        self.runner.synchronize()
        z = np.empty_like(self.x)
        self.runner.download(self.buffers["out"], z)
        return bool(np.all(np.abs(z - self.expected) <= 1e-5 * (1 + np.abs(self.expected))))

    def free(self) -> None:
        for ptr in self.buffers.values():
            self.runner.free(ptr)


def test_graph_with_its_dependency_edges_is_right_in_every_order(runner: cuda.Runner) -> None:
    chain = _Chain(runner, edge=True)
    assert chain.graph.node_count == 4
    assert all(chain.launch_is_right() for _ in range(8))
    chain.free()


@fake_only
def test_graph_missing_a_dependency_edge_gives_a_wrong_answer(runner: cuda.Runner) -> None:
    """Without the edge the second kernel may run before the first and read the poisoned y: each launch of the fake
    runs either order with probability 1/2, so launches go on until both outcomes are seen, at most 64 (the wrong
    one shows the missing edge, the right one that the failure is the order's; one outcome 64 times: 2^-63)."""
    chain = _Chain(runner, edge=False)
    outcomes: list[bool] = []
    while len(outcomes) < 64 and len(set(outcomes)) < 2:
        outcomes.append(chain.launch_is_right())
    assert not all(outcomes), "every launch ran the nodes in the declared order: the missing edge went unnoticed"
    assert any(outcomes), "no launch ran the kernels in the working order"
    chain.free()


def test_graph_kernel_node_can_be_repointed(runner: cuda.Runner) -> None:
    """cuGraphExecKernelNodeSetParams: the second kernel reads x instead of y, keeping its edge."""
    chain = _Chain(runner, edge=True)
    b = chain.buffers
    chain.graph.set_kernel(chain.exec, 2, "rms_norm_f32", [b["args"], b["x"], b["w2"], b["z"]], (chain.rows, 1, 1),
                           (256, 1, 1))
    chain.expected = _rms_norm(chain.x.astype(np.float64), chain.w2.astype(np.float64))
    assert chain.launch_is_right()
    chain.free()


def test_event_timing(runner: cuda.Runner) -> None:
    """CUDA events around enqueued work: one positive time per repeat (time_ms, which bench_kernels.py uses)."""
    src, dst = runner.alloc(1 << 20), runner.alloc(1 << 20)
    times = runner.time_ms(lambda: runner.copy(dst, src, 1 << 20), repeats=3, flush=src, flush_bytes=1 << 20)
    assert len(times) == 3 and all(t > 0 for t in times), times
    runner.free(src)
    runner.free(dst)
