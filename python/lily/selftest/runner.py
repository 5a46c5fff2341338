"""The self-test's runner: the cases of ``lily.kernel_cases`` on one device, the table, and the command line."""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lily import kernel_cases
from lily.backends.metal import missing_metal_runtime
from lily.kernel_cases import Case
from lily.selftest import device as devices
from lily.selftest.device import KernelDevice

DESCRIPTION = "Run every instantiated kernel against lily.reference on one device and print a row per case."


@dataclass
class Result:
    """One self-test row: the kernel, the shape it ran at, its error, the tolerance, and whether it passed."""

    kernel: str
    shape: str
    error: float
    tolerance: str
    passed: bool


def run(kernels: Sequence[str], device: KernelDevice | None = None, *, cases: Sequence[Case] | None = None,
        all_cases: bool = False, seed: int = 0, corrupt: Sequence[str] = ()) -> list[Result]:
    """Run the cases of each kernel on `device` (default: ``open_device("auto")``): the quick one per kernel, or every
    case with `all_cases`; `cases` replaces the case set. A kernel without a case, or whose case raises, is a failed
    row. `corrupt` names kernels whose expected results are perturbed (to show that failures are reported)."""
    device = device if device is not None else devices.open_device("auto")
    if cases is None:
        cases = kernel_cases.cases(kernels, quick=not all_cases)
    by_kernel: dict[str, list[Case]] = {}
    for case in cases:
        by_kernel.setdefault(case.kernel, []).append(case)
    results = []
    for kernel in kernels:
        if kernel not in by_kernel:
            results.append(Result(kernel, "no selftest case", math.nan, "", False))
        for case in by_kernel.get(kernel, []):
            try:
                outcome = case.run(device, seed, corrupt=kernel in corrupt)
            except Exception as exc:  # a crashing case is a failure row, and the other kernels still run
                results.append(Result(kernel, f"{case.shape}: error: {type(exc).__name__}: {exc}", math.nan, "",
                                      False))
                continue
            results.append(Result(kernel, outcome.shape, outcome.error, outcome.tolerance, outcome.passed))
    return results


def table(results: Sequence[Result]) -> str:
    """The rows as aligned text columns."""
    rows = [("kernel", "shape", "error", "tolerance", "passed")]
    rows += [(r.kernel, r.shape, f"{r.error:.3g}", r.tolerance, "yes" if r.passed else "NO") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lily.selftest", description=DESCRIPTION)
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of {kernel, shape, error, tolerance, passed}")
    parser.add_argument("--device", choices=["auto", "metal-api", "harness", "cuda"], default="auto",
                        help="metal-api: through the Metal API (the GPU on a Mac, the fake Metal on Linux); "
                             "harness: the Linux CPU execution harness; cuda: an NVIDIA GPU through the CUDA driver "
                             "(docs/cuda.md); auto (default): metal-api on a Mac, harness elsewhere")
    parser.add_argument("--compile-only", action="store_true",
                        help="with --device cuda: compile every kernel (with --kernels, the files that instantiate "
                             "a match) for the NVIDIA targets and check it with ptxas; no GPU needed")
    parser.add_argument("--ptx-out", metavar="DIR", help="with --compile-only: keep the PTX files in DIR")
    parser.add_argument("--kernels", metavar="REGEX", help="only the instantiated kernels whose name matches REGEX")
    parser.add_argument("--all", action="store_true",
                        help="every case of each kernel (the kernel tests' set), not one representative case")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--corrupt", metavar="KERNEL", action="append", default=[],
                        help="perturb KERNEL's expected result (checks that a failing case is reported)")
    return parser


def _open(kind: str) -> KernelDevice | None:
    """The device, or None after saying on stderr why it cannot be opened."""
    try:
        return devices.open_device(kind)
    except ImportError as exc:
        if kind == "harness" or platform.system() != "Darwin":
            where = "on macOS the harness is not built; use --device metal-api" if platform.system() == "Darwin" \
                else missing_metal_runtime() or f"import failed: {exc}"
            print(f"lily.selftest: the CPU kernel harness lily._ext.msl is absent ({where}). Nothing was tested.",
                  file=sys.stderr)
        else:
            print(f"lily.selftest: the Metal kernel runner lily._ext.kernels is absent (import failed: {exc}; "
                  "rebuild Lily). Nothing was tested.", file=sys.stderr)
    except RuntimeError as exc:  # no Metal/CUDA device, or the kernel source does not compile
        what = "CUDA" if kind == "cuda" else "Metal"
        print(f"lily.selftest: cannot open the {what} device: {exc}. Nothing was tested.", file=sys.stderr)
    return None


def _describe(device: KernelDevice) -> None:
    """What runs the kernels, and what it could not compile, on stderr."""
    if device.gpu_tested:
        api = "the CUDA driver API" if device.kind == "cuda" else "the Metal API"
        print(f"lily.selftest: running the kernels on the GPU '{device.name}' through {api}", file=sys.stderr)
    if device.missing:
        print(f"lily.selftest: not compiled for this GPU, so not run (their #if is false here): "
              f"{', '.join(device.missing)}", file=sys.stderr)
    for failure in device.failed_families:
        print(f"lily.selftest: the kernel family '{failure['family']}' ({failure['file']}) did not compile; its "
              f"{len(failure['kernels'])} kernels fail below. Metal says: {failure['diagnostic']}", file=sys.stderr)


def _report(results: Sequence[Result], device: KernelDevice, as_json: bool) -> None:
    if as_json:
        # Strict JSON: an error that could not be measured (NaN) is null.
        print(json.dumps([{**asdict(r), "error": r.error if math.isfinite(r.error) else None} for r in results]))
        return
    print(table(results))
    failed = sorted({r.kernel for r in results if not r.passed})
    kernels = {r.kernel for r in results}
    print(f"\n{len(kernels) - len(failed)}/{len(kernels)} kernels passed ({len(results)} cases). {device.note()}")
    if failed:
        print("failed: " + ", ".join(failed))
    if device.failed_families:
        print("families that did not compile: " + ", ".join(
            f"{f['family']} ({f['file']})" for f in device.failed_families))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (0 all passed, 1 a case failed, 2 nothing could run)."""
    args = _parser().parse_args(argv)
    if args.compile_only:
        if args.device != "cuda":
            print("lily.selftest: --compile-only needs --device cuda", file=sys.stderr)
            return 2
        from lily.selftest.compile_cuda import compile_cuda

        return compile_cuda(args.ptx_out, args.kernels)
    device = _open(args.device)
    if device is None:
        return 2
    _describe(device)
    kernels = device.kernels
    if args.kernels:
        pattern = re.compile(args.kernels)
        kernels = [k for k in kernels if pattern.search(k)]
        if not kernels:
            print(f"lily.selftest: --kernels {args.kernels!r} matches no instantiated kernel", file=sys.stderr)
            return 2
    unknown = [k for k in args.corrupt if k not in kernels]
    if unknown:
        print(f"lily.selftest: --corrupt names kernels that are not run: {unknown}", file=sys.stderr)
        return 2
    results = run(kernels, device, all_cases=args.all, seed=args.seed, corrupt=args.corrupt)
    _report(results, device, args.json)
    return 0 if all(r.passed for r in results) else 1
