#!/usr/bin/env python3
"""Decode-kernel bandwidth on an NVIDIA GPU (docs/performance.md, "Decode kernels on the H200"): each kernel at the
model's shapes, timed as the median of repeated CUDA-event timings with the L2 cache flushed before each run, its
bytes moved per second against a device-to-device copy measured in the same run. A benchmark, not a test.

    LILY_CUDA_PTX_DIR=build/ptx python scripts/bench_kernels.py [--repeats 50] [--kernels REGEX] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from lily import cuda  # noqa: E402

# Qwen3.5/3.6-35B-A3B shapes (hidden 2048, vocab 248,320).
HIDDEN, VOCAB = 2048, 248320


@dataclass
class Case:
    label: str
    kernel: str
    buffers: list  # bytes (setBytes data) or int (a buffer of that many bytes, random contents)
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    bytes_moved: int  # bytes the kernel must read and write at least


# The qmv threadgroup shape (metal/lily.h): LILY_QMV_ROWS_PER_SIMDGROUP, LILY_QMV_SIMDGROUPS, LILY_QMV_MAX_ROWS;
# --qmv-shape overrides them to time PTX built with other values.
QMV_SHAPE = {"rows_per_simdgroup": 4, "simdgroups": 2, "batch": 4}


def qmv_case(label: str, n: int, k: int, m: int = 1, kernel: str = "qmv_q4_g64_bf16") -> Case:
    rows_per_tg = QMV_SHAPE["rows_per_simdgroup"] * QMV_SHAPE["simdgroups"]
    w, s = n * k // 2, n * (k // 64) * 2
    return Case(label, kernel, [struct.pack("<IIII", k, n, m, 0), m * k * 2, w, s, s, m * n * 2],
                (-(-n // rows_per_tg), -(-m // QMV_SHAPE["batch"]), 1), (32 * QMV_SHAPE["simdgroups"], 1, 1),
                w + 2 * s + m * k * 2 + m * n * 2)


def rms_norm_case() -> Case:
    """The decode RMSNorm: one row of H (latency-bound: a few KB)."""
    return Case("rms_norm 1x2048", "rms_norm_bf16", [struct.pack("<IfII", HIDDEN, 1e-6, 0, 0), HIDDEN * 2, HIDDEN * 2,
                                                     HIDDEN * 2], (1, 1, 1), (256, 1, 1), 3 * HIDDEN * 2)


def embedding_case() -> Case:
    """One token's embedding row (id 12345) from the 4-bit table: latency-bound (a few KB)."""
    w, s = VOCAB * HIDDEN // 2, VOCAB * (HIDDEN // 64) * 2
    return Case("embedding 1 token", "embedding_gather_q4_g64_bf16",
                [struct.pack("<IIII", HIDDEN, VOCAB, 0, 0), struct.pack("<I", 12345), w, s, s, HIDDEN * 2], (1, 1, 1), (256, 1, 1),
                HIDDEN // 2 + 2 * (HIDDEN // 64) * 2 + HIDDEN * 2)


def cases() -> list[Case]:
    return [
        rms_norm_case(),
        embedding_case(),
        qmv_case("qmv lm_head 1x248320x2048", VOCAB, HIDDEN),
        qmv_case("qmv lm_head M=4", VOCAB, HIDDEN, 4),
        qmv_case("qmv 1x2048x2048", 2048, HIDDEN),
        qmv_case("qmv 2048x2048 M=4", 2048, HIDDEN, 4),
        qmv_case("qmv q_proj 1x8192x2048", 8192, HIDDEN),
        qmv_case("qmv o_proj 1x2048x4096", HIDDEN, 4096),
        qmv_case("qmv 1x65536x4096", 65536, 4096),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--kernels", help="only cases whose label matches REGEX")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--qmv-shape", nargs=3, type=int, metavar=("ROWS", "SIMDGROUPS", "BATCH"),
                        help="the LILY_QMV_* values the PTX was built with (default 4 2 4)")
    args = parser.parse_args(argv)
    if args.qmv_shape:
        QMV_SHAPE.update(zip(("rows_per_simdgroup", "simdgroups", "batch"), args.qmv_shape))
    gpu = cuda.Runner()
    rng = np.random.default_rng(0)
    flush_bytes = 512 << 20  # several times the H200's 60 MB L2
    flush = gpu.alloc(flush_bytes)

    copy_bytes = 1 << 30
    src, dst = gpu.alloc(copy_bytes), gpu.alloc(copy_bytes)
    copy_ms = statistics.median(gpu.time_ms(lambda: gpu.copy(dst, src, copy_bytes), args.repeats, flush, flush_bytes))
    copy_gbs = 2 * copy_bytes / copy_ms / 1e6  # read + write
    gpu.free(src)
    gpu.free(dst)
    rows = [{"case": "device-to-device copy 1 GiB", "kernel": "cuMemcpyDtoD", "us": copy_ms * 1e3,
             "gbs": copy_gbs, "fraction": 1.0}]
    selected = [c for c in cases() if not args.kernels or re.search(args.kernels, c.label)]
    for c in selected:
        pointers = []
        for b in c.buffers:
            if isinstance(b, bytes):
                p = gpu.alloc(len(b))
                gpu.upload(p, b)
            else:  # small random bf16-range values: finite, so timings do not depend on NaN paths
                p = gpu.alloc(b)
                gpu.upload(p, (rng.integers(0x3C00, 0x3F80, size=-(-b // 2), dtype=np.uint16)).tobytes()[:b])
            pointers.append(p)
        warm_ms = statistics.median(gpu.time_ms(lambda: gpu.launch(c.kernel, pointers, c.grid, c.threads), args.repeats))
        ms = statistics.median(gpu.time_ms(lambda: gpu.launch(c.kernel, pointers, c.grid, c.threads), args.repeats,
                                           flush, flush_bytes))
        gbs = c.bytes_moved / ms / 1e6
        rows.append({"case": c.label, "kernel": c.kernel, "us": ms * 1e3, "warm_us": warm_ms * 1e3, "gbs": gbs,
                     "fraction": gbs / copy_gbs, "bytes": c.bytes_moved})
        for p in pointers:
            gpu.free(p)
    print(f"GPU: {gpu.device_name} (sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}); median of "
          f"{args.repeats} CUDA-event timings, L2 flushed ({flush_bytes >> 20} MiB written) before each")
    print(f"| case | kernel | µs (cold L2) | µs (warm) | GB/s | fraction of copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        warm = f"{r['warm_us']:.1f}" if "warm_us" in r else ""
        print(f"| {r['case']} | `{r['kernel']}` | {r['us']:.1f} | {warm} | {r['gbs']:,.0f} | {r['fraction']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
