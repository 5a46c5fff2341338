#!/usr/bin/env python3
"""Compile every kernel of metal/*.metal to PTX for NVIDIA GPUs and check it with ptxas (docs/cuda.md).

The same rewrite as the CPU harness (msl2cpu.py --target cuda), then clang in CUDA device mode through the shim
(src/msl_cpu/include/msl_cuda.h), linked with NVIDIA's libdevice; ptxas assembles the PTX for every checked
architecture. No CUDA headers, no nvcc, no GPU needed.

    cuda_kernels.py OUT_DIR [--arch sm_90] [--check-arch sm_80 sm_90] [--source metal/x.metal ...]
                                                    -> OUT_DIR/<stem>.ptx per metal file (--check-arch alone: no ptxas)
    cuda_kernels.py --toolchain                     -> prints the toolchain, or why there is none (exit 1)

CMake runs it per file at build time (CMakeLists.txt, "CUDA kernels") where --toolchain succeeds.

Toolchain: clang (LILY_CLANG, else clang++-19 / clang++ on PATH), and libdevice + ptxas from the CUDA toolkit
(LILY_CUDA_HOME, CUDA_HOME, CUDA_PATH, /usr/local/cuda, ptxas on PATH) or else NVIDIA's pip package
nvidia-cuda-nvcc (the `test` extra installs it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import msl2cpu  # noqa: E402  (the one rewriter, CUDA target)

# PTX is built for the GPU it runs on best; the driver JIT-compiles it for any newer GPU. ptxas checks every
# architecture Lily claims: sm_80 (A100, and the PTX baseline of the Ampere/Ada/Blackwell generations) and sm_90
# (H100/H200, the one measured).
DEFAULT_ARCH = "sm_90"
CHECK_ARCHS = ("sm_80", "sm_90")
CLANG_FLAGS = [
    "-x", "cuda", "--cuda-device-only", "-nogpuinc", "-nogpulib", "-O3", "-std=c++17",
    "-Wno-unknown-cuda-version", "-Wno-unknown-attributes",
    "-ffp-contract=off",  # a*b+c rounds twice, as on the CPU harness and in Metal without fast math
    "-Xclang", "-ffloat16-excess-precision=none", "-Xclang", "-fbfloat16-excess-precision=none",
]
ENTRY_RE = re.compile(r"^\.(?:visible|weak)?\s*\.entry\s+(\w+)\s*\(", re.M)


class ToolchainError(RuntimeError):
    """A piece of the NVIDIA toolchain is missing; the message says which and where it was looked for."""


@dataclass(frozen=True)
class Toolchain:
    clang: str
    libdevice: Path
    ptxas: str


def _pip_nvidia_dirs() -> list[Path]:
    """nvidia/* package folders of NVIDIA's pip wheels (nvidia-cuda-nvcc) wherever this interpreter imports from: its
    site-packages, a user site, or the paths a venv inherits."""
    dirs = []
    for entry in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path]):
        base = Path(entry or ".") / "nvidia"
        if base.is_dir():
            dirs += sorted(p for p in base.iterdir() if p.is_dir() and p not in dirs)
    return dirs


MIN_CLANG = 19  # CUDA device mode through the shim: ext_vector_type, __bf16 arithmetic, NVPTX of clang 19


def _clang_major(clang: str) -> int:
    try:
        out = subprocess.run([clang, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r"clang version (\d+)", out)
    return int(m.group(1)) if m else 0


def find_toolchain() -> Toolchain:
    clang = os.environ.get("LILY_CLANG") or shutil.which("clang++-19") or shutil.which("clang++")
    if not clang:
        raise ToolchainError("no clang++ (set LILY_CLANG or install clang-19): it compiles the kernels for CUDA")
    if _clang_major(clang) < MIN_CLANG:
        raise ToolchainError(f"{clang} is not clang {MIN_CLANG} or newer (set LILY_CLANG or install clang-19)")
    homes = [os.environ.get(v) for v in ("LILY_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    ptxas_on_path = shutil.which("ptxas")
    if ptxas_on_path:
        homes.append(str(Path(ptxas_on_path).resolve().parent.parent))
    candidates = [Path(h) for h in homes if h] + _pip_nvidia_dirs()
    libdevice = next((c / "nvvm/libdevice/libdevice.10.bc" for c in candidates
                      if (c / "nvvm/libdevice/libdevice.10.bc").is_file()), None)
    ptxas = next((str(c / "bin/ptxas") for c in candidates if (c / "bin/ptxas").is_file()), None)
    if libdevice is None or ptxas is None:
        missing = " and ".join(n for n, v in (("libdevice.10.bc", libdevice), ("ptxas", ptxas)) if v is None)
        raise ToolchainError(f"no {missing}: looked in {', '.join(str(c) for c in candidates)} "
                             "(install the CUDA toolkit or `pip install nvidia-cuda-nvcc`)")
    return Toolchain(clang, libdevice, ptxas)


def metal_sources(metal_dir: Path = ROOT / "metal") -> list[Path]:
    return sorted(metal_dir.glob("*.metal"))


def compile_source(source: Path, out_dir: Path, tc: Toolchain, arch: str = DEFAULT_ARCH) -> Path:
    """metal/<stem>.metal -> OUT_DIR/<stem>.cu -> OUT_DIR/<stem>.ptx; raises CalledProcessError with clang's output."""
    cu = msl2cpu.generate_cuda(source, out_dir)
    ptx = out_dir / f"{source.stem}.ptx"
    cmd = [tc.clang, *CLANG_FLAGS, f"--cuda-gpu-arch={arch}", "-Xclang", "-mlink-builtin-bitcode",
           "-Xclang", str(tc.libdevice), "-I", str(ROOT / "src/msl_cpu/include"), "-I", str(ROOT / "src/msl_cpu"),
           "-I", str(source.parent), "-S", str(cu), "-o", str(ptx)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ptx


def ptxas_check(ptx: Path, tc: Toolchain, arch: str) -> None:
    """Assembles `ptx` for `arch` (the output is discarded): what the driver would do at load time."""
    subprocess.run([tc.ptxas, f"-arch={arch}", str(ptx), "-o", os.devnull], check=True, capture_output=True,
                   text=True)


def check_local_addresses(ptx: Path) -> None:
    """Fails on a generic ld/st whose address is a local-window address (%SPL or cvta.to.local, plus offsets): the
    miscompilation seen with clang 19 (attention_prep), which writes to a wild global address on the GPU."""
    for body in re.split(r"\n\.(?:visible |weak )?\.(?:entry|func) ", ptx.read_text())[1:]:
        local = {"%SPL"}  # the frame's local address; %SP is its generic form
        for line in body.splitlines():
            if m := re.match(r"\s*cvta\.to\.local\.u64\s+(%\w+),", line):
                local.add(m.group(1))
            elif (m := re.match(r"\s*(?:add|sub|mov)\.\w+\s+(%\w+),\s*(%\w+)(?:,\s*(%?\w+))?", line)) and \
                    (m.group(2) in local or m.group(3) in local):
                local.add(m.group(1))
            elif (m := re.match(r"\s*(?:st|ld)(?:\.v\d)?\.[fubs]\d+\s+[^\[]*\[(%\w+)", line)) and m.group(1) in local:
                raise RuntimeError(f"{ptx.name}: kernel {body.split('(')[0]}: generic access through a local "
                                   f"address: {line.strip()}")


def _arch_dir(out_dir: Path, arch: str) -> Path:
    d = out_dir / f"check_{arch}"
    d.mkdir(exist_ok=True)
    return d


def entry_names(ptx: Path) -> list[str]:
    return ENTRY_RE.findall(ptx.read_text())


def build(out_dir: Path, arch: str = DEFAULT_ARCH, check_archs: tuple[str, ...] = CHECK_ARCHS,
          sources: list[Path] | None = None, jobs: int | None = None) -> dict[str, list[str]]:
    """Compiles and checks every source; returns {ptx file name: [kernel host names]}. Raises RuntimeError naming
    every file that failed with the compiler's or assembler's message."""
    tc = find_toolchain()
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = metal_sources() if sources is None else sources

    def one(source: Path) -> tuple[str, list[str]]:
        ptx = compile_source(source, out_dir, tc, arch)
        check_local_addresses(ptx)
        for a in check_archs:  # PTX for another architecture is compiled for it, beside the one kept
            checked = ptx if a == arch else compile_source(source, _arch_dir(out_dir, a), tc, a)
            ptxas_check(checked, tc, a)
        return ptx.name, entry_names(ptx)

    result, errors = {}, []
    with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 2) as pool:
        for source, fut in [(s, pool.submit(one, s)) for s in sources]:
            try:
                name, entries = fut.result()
                result[name] = entries
            except subprocess.CalledProcessError as e:
                errors.append(f"{source.name}: {Path(e.cmd[0]).name} failed:\n{e.stderr.strip()[-4000:]}")
            except msl2cpu.RewriteError as e:
                errors.append(f"{source.name}: {e}")
    if errors:
        raise RuntimeError("CUDA kernel build failed:\n" + "\n".join(errors))
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="the PTX target (default %(default)s)")
    parser.add_argument("--check-arch", nargs="*", default=list(CHECK_ARCHS),
                        help="ptxas targets checked (none: no ptxas run)")
    parser.add_argument("--source", type=Path, action="append", help="only these .metal files (default: metal/)")
    parser.add_argument("--toolchain", action="store_true", help="print the toolchain found, or why none is")
    parser.add_argument("-j", "--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    if args.toolchain:
        try:
            tc = find_toolchain()
        except ToolchainError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"{tc.clang}, {tc.libdevice}, {tc.ptxas}")
        return 0
    if args.out_dir is None:
        parser.error("OUT_DIR is required")
    try:
        built = build(args.out_dir, args.arch, tuple(args.check_arch), sources=args.source, jobs=args.jobs)
    except (ToolchainError, RuntimeError) as e:
        print(f"cuda_kernels: error: {e}", file=sys.stderr)
        return 1
    n = sum(len(v) for v in built.values())
    checked = f"ptxas {' '.join(args.check_arch)}: ok" if args.check_arch else "not assembled (no --check-arch)"
    print(f"cuda_kernels: {n} kernels in {len(built)} PTX files, {checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
