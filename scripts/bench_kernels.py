#!/usr/bin/env python3
"""Decode-kernel bandwidth on an NVIDIA GPU (docs/performance.md, "Decode kernels on the H200"): every kernel of the
decode step at the full-size model's shapes, timed as the median of repeated CUDA-event timings with the L2 cache
flushed before each run, its bytes moved per second against a device-to-device copy measured in the same run: a copy
of 1 GiB (the bandwidth the fractions are of) and a copy that moves the kernel's own bytes, timed the same way (what
a memory-bound kernel of that size could hope for, launch and ramp-up included). A benchmark, not a test: it exits
non-zero when a kernel fails to launch or run.

    LILY_CUDA_PTX_DIR=build/ptx python scripts/bench_kernels.py [--repeats 20] [--kernels REGEX] [--json OUT]
    python scripts/bench_kernels.py --dry-run      # the case list (and, with PTX, every case's arguments checked)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

if importlib.util.find_spec("lily") is None:  # not installed: the checkout's package (it needs a built extension)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from lily import cuda  # noqa: E402

# Qwen3.5/3.6-35B-A3B shapes (python/lily/plan.py, full_size_args).
HIDDEN, VOCAB = 2048, 248320
GDN_K_HEADS, GDN_V_HEADS, GDN_K_DIM, GDN_V_DIM, CONV_K = 16, 32, 128, 128, 4
GDN_CONV_CHANNELS = 2 * GDN_K_HEADS * GDN_K_DIM + GDN_V_HEADS * GDN_V_DIM  # 8192: in_proj_qkv rows
ATTN_HEADS, ATTN_KV_HEADS, HEAD_DIM = 16, 2, 256
EXPERTS, TOP_K, EXPERT_SIZE, SHARED_SIZE = 256, 8, 512, 512
EPS = 1e-6

# Kernel shapes the host uses (metal/lily.h, src/lily_ext/tuning.h); --qmv-shape overrides the qmv ones to time PTX
# built with other LILY_QMV_* values.
QMV_SHAPE = {"rows_per_simdgroup": 4, "simdgroups": 2, "batch": 4}
QMV_STREAM_GROUPS = 4 * 132  # tuning::kQmvStreamGroups: the streaming staged lm_head's most threadgroups
QMV_CONV_STREAM_GROUPS = 3 * 132  # tuning::kQmvConvStreamGroups: the conv GEMV's
QMV_STAGED = {"simdgroups": 4}  # LILY_QMV_STAGED_SIMDGROUPS: the staged GEMVs' threadgroups; --qmv-staged overrides
# The staged kernels' instance: "_a16" (a pack of codes as one 16-byte load), the engine's where the codes lie on 16
# bytes, as here (each buffer its own allocation) and in a full-size file (tuning::whole_pack_loads); --word-loads: "".
STAGED_LOADS = {"suffix": "_a16"}
QMM_BN, QMM_BM16, QMM_THREADS = 64, 16, 128  # LILY_GEMM_BN, LILY_QMM_BM16_MAX_ROWS, LILY_GEMM_THREADS
# LILY_QMV_MMA_ROWS; the simdgroups splitting K by output features as tuning::qmv_mma_simdgroups (8 below 8192
# outputs, else 4) unless --qmv-mma fixes them.
QMV_MMA = {"rows": 16, "simdgroups": 0, "wide_min_out_features": 8192, "narrow": 8, "wide": 4}
QMM_MIN_THREADGROUPS = 64 * 8  # tuning::kQmmMinThreadgroups
MOE_GEMV_ROWS, MOE_GEMV_THREADS = 8, 64
MOE_DOWN_ROWS, MOE_DOWN_THREADS = 8, 128
ATTN_HEADS_PER_GROUP, ATTN_THREADS = 4, 256
ATTN_COMBINE_THREADS, ATTN_COMBINE_SLICE = 256, 32  # tuning::kAttentionCombineThreads, kAttentionCombineSlice
# attention_prefill_mma: LILY_ATTN_MMA_QUERIES query tokens x LILY_ATTN_MMA_HEADS_PER_GROUP heads per threadgroup.
ATTN_MMA_QUERIES, ATTN_MMA_HEADS_PER_GROUP = 8, 8
# attention_decode_partial_mma (the engine's split-KV pass 1 where MMA_ATTENTION is on): the whole GQA group per
# threadgroup, LILY_ATTN_DECODE_MMA_SIMDGROUPS simdgroups.
ATTN_DECODE_MMA_SIMDGROUPS = 8
# Split-KV decode (LILY_ATTN_SPLIT_MIN_KEYS, LILY_ATTN_SPLIT_MAX_BLOCKS, LILY_ATTN_SPLIT_SHORT_BLOCK_KEYS: CUDA's unit;
# the rule is tuning::attention_split_blocks).
ATTN_SPLIT_MIN_KEYS, ATTN_SPLIT_MAX_BLOCKS, ATTN_SPLIT_SHORT_BLOCK_KEYS = 256, 64, 64
GDN_ROWS_PER_SIMDGROUP = 8
ARGMAX_BLOCK, ARGMAX_THREADS, SAMPLE_THREADS = 4096, 256, 1024
SAMPLE_BLOCK, SAMPLE_CANDIDATES, SAMPLE_PARTIAL_THREADS, SAMPLE_FINAL_THREADS = 4096, 64, 256, 256
EMBEDDING_THREADS, RMS_NORM_THREADS = 256, 256


@dataclass(frozen=True)
class Same:
    """A binding of the same device buffer as an earlier argument (aliasing, or an unused segment's slot)."""
    index: int


@dataclass
class Case:
    label: str
    kernel: str
    # bytes: setBytes data (also small exact contents: ids); int: a device buffer of that many bytes with finite
    # random bf16-range contents; Same(i): argument i's buffer again.
    buffers: list
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    bytes_moved: int  # bytes the kernel must read and write at least
    note: str = field(default="")
    flops: int = 0  # multiply-adds x 2 of a GEMM (prefill cases): the table adds TFLOP/s


def bf16(n: int) -> int:
    return 2 * n


def f32(n: int) -> int:
    return 4 * n


def quantized(rows: int, cols: int, bits: int = 4) -> tuple[int, int]:
    """(code bytes, scale bytes = bias bytes) of an MLX affine weight, group 64, bf16 scales."""
    return rows * cols * bits // 8, rows * (cols // 64) * 2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- qmv / qmm ----

def _qmv_grid(n: int, m: int, staged: bool = False) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    simdgroups = QMV_STAGED["simdgroups"] if staged else QMV_SHAPE["simdgroups"]
    rows_per_tg = QMV_SHAPE["rows_per_simdgroup"] * simdgroups
    return (ceil_div(n, rows_per_tg), ceil_div(m, QMV_SHAPE["batch"]), 1), (32 * simdgroups, 1, 1)


def step_slots(k: int, bits: int = 4) -> int:
    """tuning::qmv_step_slots (SPLIT_STEPS on): 2 where a row has more than one step (32 lanes x
    LILY_QMV_PACKS_PER_LANE packs: 2,048 codes at 4 bits, 1,024 at 8), else 1; the split GEMVs' threads (128, slots)."""
    return 2 if k > 64 * 128 // bits else 1


def qmv_case(label: str, n: int, k: int, m: int = 1, bits: int = 4, f32_out: bool = False) -> Case:
    w, s = quantized(n, k, bits)
    grid, threads = _qmv_grid(n, m)
    y = f32(m * n) if f32_out else bf16(m * n)
    return Case(label, f"qmv_q{bits}_g64_bf16" + ("_of32" if f32_out else ""),
                [struct.pack("<IIII", k, n, m, 0), bf16(m * k), w, s, s, y], grid, threads, w + 2 * s + bf16(m * k) + y)


def qmv_mma_case(label: str, n: int, k: int, m: int = 1, f32_out: bool = False) -> Case:
    """The GEMV on matrix units (tuning::mma_gemv, CUDA's choice for up to 8 rows): 8 input rows per threadgroup row,
    the engine's simdgroups for n outputs (tuning::qmv_mma_simdgroups)."""
    w, s = quantized(n, k)
    y = f32(m * n) if f32_out else bf16(m * n)
    simdgroups = QMV_MMA["simdgroups"] or (QMV_MMA["wide"] if n >= QMV_MMA["wide_min_out_features"]
                                           else QMV_MMA["narrow"])
    return Case(label, "qmv_mma_q4_g64_bf16" + ("_of32" if f32_out else ""),
                [struct.pack("<IIII", k, n, m, 0), bf16(m * k), w, s, s, y],
                (ceil_div(n, QMV_MMA["rows"]), ceil_div(m, 8), 1), (32 * simdgroups, 1, 1),
                w + 2 * s + bf16(m * k) + y)


def qmm_case(label: str, n: int, k: int, m: int, bits: int = 4, f32_out: bool = False) -> Case:
    """What the host runs for M <= 16 where qmv does not take M (tuning::qmv_takes): the 16-row GEMM tile."""
    w, s = quantized(n, k, bits)
    y = f32(m * n) if f32_out else bf16(m * n)
    return Case(label, f"qmm_q{bits}_g64_bf16" + ("_of32" if f32_out else "") + "_bm16",
                [struct.pack("<IIII", k, n, m, 0), bf16(m * k), w, s, s, y],
                (ceil_div(n, QMM_BN), ceil_div(m, QMM_BM16), 1), (QMM_THREADS, 1, 1), w + 2 * s + bf16(m * k) + y)


def qmv_norm_case(label: str, n: int, k: int, staged: bool = False, argmax: bool = False) -> Case:
    """lm_head after the final RMSNorm (fusion on), writing f32 logits (the engine's in every precision); `staged`:
    the CUDA variant (x staged in threadgroup memory); `argmax`: the greedy step's, which also writes each
    threadgroup's best logit (FUSED_ARGMAX)."""
    w, s = quantized(n, k)
    grid, threads = _qmv_grid(n, 1, staged)
    if staged:  # it streams row blocks on at most QMV_STREAM_GROUPS threadgroups, as the engine launches it
        grid = (min(grid[0], QMV_STREAM_GROUPS), 1, 1)
    partials = [f32(grid[0]), f32(grid[0])] if argmax else []
    name = "qmv_norm" + ("_argmax" if argmax else "") + ("_staged" if staged else "") + "_q4_g64_bf16_of32"
    return Case(label, name, [struct.pack("<IIIf", k, n, 1, EPS), bf16(k), bf16(k), w, s, s, f32(n), *partials],
                grid, threads, w + 2 * s + 2 * bf16(k) + f32(n) + sum(partials))


def qmv_residual_case(label: str, n: int, k: int, staged: bool = False, split: bool = True, note: str = "") -> Case:
    """DeltaNet out_proj / attention o_proj: out = residual + W x, in place on the hidden stream; staged, with the
    engine's step slots (`split`, SPLIT_STEPS) or one."""
    w, s = quantized(n, k)
    grid, threads = _qmv_grid(n, 1, staged)
    if staged:
        threads = (threads[0], step_slots(k) if split else 1, 1)
    return Case(label, f"qmv_residual{'_staged' if staged else ''}_q4_g64_bf16",
                [struct.pack("<IIII", k, n, 1, 0), bf16(k), w, s, s, bf16(n), Same(5)], grid, threads,
                w + 2 * s + bf16(k) + 2 * bf16(n), note)


def qmv_norm_seg_case(label: str, rows: list[int], k: int, bits: int = 4, f32_out: bool = False,
                      staged: bool = False, split: bool = True, note: str = "") -> Case:
    """The fused projections of one input (FUSED_PROJECTIONS and FUSION on): up to 4 matrices, each its own buffers;
    staged, with the engine's step slots (`split`, SPLIT_STEPS) or one."""
    buffers: list = [struct.pack("<IIIf4I", k, sum(rows), len(rows), EPS, *(rows + [0] * (4 - len(rows)))),
                     bf16(k), bf16(k)]
    moved, groups = 2 * bf16(k), 0
    simdgroups = QMV_STAGED["simdgroups"] if staged else QMV_SHAPE["simdgroups"]
    rows_per_tg = QMV_SHAPE["rows_per_simdgroup"] * simdgroups
    for i in range(4):
        if i < len(rows):
            w, s = quantized(rows[i], k, bits)
            buffers += [w, s, s]
            moved += w + 2 * s
            groups += ceil_div(rows[i], rows_per_tg)
        else:
            buffers += [Same(3), Same(4), Same(5)]
    out = f32(sum(rows)) if f32_out else bf16(sum(rows))
    buffers.append(out)
    suffix = "_of32" if f32_out else ""
    slots = step_slots(k, bits) if staged and split else 1
    return Case(label, f"qmv_norm_seg{'_staged' if staged else ''}_q{bits}_g64_bf16{suffix}", buffers, (groups, 1, 1),
                (32 * simdgroups, slots, 1), moved + out, note)


# ---- the other decode kernels ----

def rms_norm_case() -> Case:
    """A decode RMSNorm of the hidden stream (FUSION off; latency-bound: a few KB)."""
    return Case("rms_norm 1x2048", "rms_norm_bf16", [struct.pack("<IfII", HIDDEN, EPS, 0, 0), bf16(HIDDEN),
                                                     bf16(HIDDEN), bf16(HIDDEN)],
                (1, 1, 1), (RMS_NORM_THREADS, 1, 1), 3 * bf16(HIDDEN))


def embedding_case() -> Case:
    """One token's embedding row (id 12345) from the 4-bit table: latency-bound (a few KB)."""
    w, s = quantized(VOCAB, HIDDEN)
    return Case("embedding 1 token", "embedding_gather_q4_g64_bf16",
                [struct.pack("<IIII", HIDDEN, VOCAB, 0, 0), struct.pack("<I", 12345), w, s, s, bf16(HIDDEN)],
                (1, 1, 1), (EMBEDDING_THREADS, 1, 1), HIDDEN // 2 + 2 * (HIDDEN // 64) * 2 + bf16(HIDDEN))


def _moe_args() -> bytes:
    return struct.pack("<8I", 1, EXPERTS, TOP_K, HIDDEN, EXPERT_SIZE, SHARED_SIZE, 0, 0)


def _expert_ids() -> bytes:
    """8 distinct experts spread over the stack (the kernels read only these)."""
    return struct.pack(f"<{TOP_K}I", *(int(e) for e in np.linspace(3, EXPERTS - 5, TOP_K)))


def _router_output() -> bytes:
    """E router logits (normal, so the routing picks distinct experts as a trained router does) and a gate logit."""
    return np.random.default_rng(3).standard_normal(EXPERTS + 1).astype(np.float32).tobytes()


def _gate_up_weights() -> tuple[list, int]:
    """gate, up (stacked experts), shared gate, shared up: codes, scales, biases each; bytes of k experts read."""
    ew, es = quantized(EXPERTS * EXPERT_SIZE, HIDDEN)
    sw, ss = quantized(SHARED_SIZE, HIDDEN)
    one_w, one_s = quantized(EXPERT_SIZE, HIDDEN)
    return [ew, es, es, ew, es, es, sw, ss, ss, sw, ss, ss], 2 * TOP_K * (one_w + 2 * one_s) + 2 * (sw + 2 * ss)


def moe_cases() -> list[Case]:
    hidden = f32(TOP_K * EXPERT_SIZE + SHARED_SIZE)
    gate_up_grid = (ceil_div(max(EXPERT_SIZE, SHARED_SIZE), MOE_GEMV_ROWS), TOP_K + 1, 1)
    weights, weight_bytes = _gate_up_weights()
    dw, ds = quantized(EXPERTS * HIDDEN, EXPERT_SIZE)
    sdw, sds = quantized(HIDDEN, SHARED_SIZE)
    one_w, one_s = quantized(HIDDEN, EXPERT_SIZE)
    routed_args = _moe_args() + struct.pack("<fIII", EPS, 0, 0, 0)
    staged_rows = 4 * QMV_STAGED["simdgroups"]  # LILY_QMV_ROWS_PER_SIMDGROUP rows per simdgroup
    return [
        Case("moe_route top-8 of 256", "moe_route_f32",
             [_moe_args(), f32(EXPERTS), f32(TOP_K), f32(TOP_K)], (1, 1, 1), (32, 1, 1),
             f32(EXPERTS) + 2 * f32(TOP_K), "FUSION off"),
        Case("moe gate/up+SwiGLU, 8 experts + shared", "moe_gate_up_swiglu_bf16",
             [_moe_args(), bf16(HIDDEN), _expert_ids(), *weights, hidden], gate_up_grid, (MOE_GEMV_THREADS, 1, 1),
             bf16(HIDDEN) + f32(TOP_K) + weight_bytes + hidden, "FUSION off"),
        Case("moe route+norm+gate/up+SwiGLU (fused)", "moe_gate_up_swiglu_routed_bf16",
             [routed_args, bf16(HIDDEN), bf16(HIDDEN), f32(EXPERTS), f32(TOP_K), f32(TOP_K), *weights, hidden],
             gate_up_grid, (MOE_GEMV_THREADS, 1, 1),
             2 * bf16(HIDDEN) + f32(EXPERTS) + 2 * f32(TOP_K) + weight_bytes + hidden),
        Case("moe route+norm+gate/up+SwiGLU (fused, staged)", "moe_gate_up_swiglu_routed_staged_bf16",
             [routed_args, bf16(HIDDEN), bf16(HIDDEN), f32(EXPERTS), f32(TOP_K), f32(TOP_K), *weights, hidden],
             (ceil_div(max(EXPERT_SIZE, SHARED_SIZE), staged_rows), TOP_K + 1, 1),
             (32 * QMV_STAGED["simdgroups"], 1, 1),
             2 * bf16(HIDDEN) + f32(EXPERTS) + 2 * f32(TOP_K) + weight_bytes + hidden),
        Case("moe down+combine+residual, 8 experts + shared", "moe_down_combine_bf16",
             [_moe_args(), hidden, _expert_ids(), f32(TOP_K), dw, ds, ds, sdw, sds, sds, f32(1), bf16(HIDDEN),
              Same(11)], (ceil_div(HIDDEN, MOE_DOWN_ROWS), 1, 1), (MOE_DOWN_THREADS, 1, 1),
             hidden + 2 * f32(TOP_K) + TOP_K * (one_w + 2 * one_s) + sdw + 2 * sds + f32(1) + 2 * bf16(HIDDEN)),
        # The staged kernel routes again from the router's output (E logits, then the shared expert's gate logit).
        Case("moe down+combine+residual, 8 experts + shared (staged)", "moe_down_combine_staged_bf16",
             [_moe_args(), hidden, _router_output(), _expert_ids(), f32(TOP_K), dw, ds, ds, sdw, sds, sds, bf16(HIDDEN),
              Same(11)], (ceil_div(HIDDEN, MOE_DOWN_ROWS), 1, 1), (MOE_DOWN_THREADS, 1, 1),
             hidden + f32(EXPERTS + 1) + TOP_K * (one_w + 2 * one_s) + sdw + 2 * sds + 2 * bf16(HIDDEN)),
    ]


def attention_split_blocks(keys: int) -> int:
    """Split-KV blocks the CUDA engine picks at `keys` keys (tuning::attention_split_blocks with CUDA's short blocks;
    0 = single pass): from ATTN_SPLIT_MIN_KEYS on, 2^floor(log2(2 * keys / ATTN_SPLIT_SHORT_BLOCK_KEYS)), up to
    ATTN_SPLIT_MAX_BLOCKS."""
    if keys < ATTN_SPLIT_MIN_KEYS:
        return 0
    blocks = 1
    while blocks < ATTN_SPLIT_MAX_BLOCKS and blocks * ATTN_SPLIT_SHORT_BLOCK_KEYS <= keys:
        blocks *= 2
    return blocks


def attention_cases() -> list[Case]:
    """Decode attention over a bf16 KV cache, as the engine launches it: the single pass at 64 keys (below the split)
    and the split-KV pair (partials over the rule's block count, then the combine) at 1K, 4K and 32K keys, on matrix
    units (the partials with the prep fused in, FUSED_ATTENTION_PREP, beside the prep and the unfused partials), the
    vector kernels (MMA_ATTENTION off) and the single pass (split-KV off)."""
    q = bf16(ATTN_HEADS * HEAD_DIM)
    packs = ceil_div(ATTN_HEADS, ATTN_HEADS_PER_GROUP)
    # The prep's inputs: q_proj's [query | gate] rows, k, v and the two norms (buffers 2 .. 6 of the fused kernel).
    prep_inputs = [2 * q, bf16(ATTN_KV_HEADS * HEAD_DIM), bf16(ATTN_KV_HEADS * HEAD_DIM), bf16(HEAD_DIM),
                   bf16(HEAD_DIM)]
    prep_bytes = sum(prep_inputs)
    mma_groups = ceil_div(ATTN_HEADS, ATTN_MMA_HEADS_PER_GROUP)
    mma_threads = (32 * ATTN_DECODE_MMA_SIMDGROUPS, 1, 1)
    cases = []
    for keys, label, single in ((64, "64", True), (1024, "1K", False), (4096, "4K", True), (32768, "32K", True)):
        cache = bf16(ATTN_KV_HEADS * keys * HEAD_DIM)
        # lily::AttentionPrepArgs: one token at position keys - 1, the model's rotary dim 64, theta 1e7, eps 1e-6.
        prep_args = struct.pack("<6I2f", 1, ATTN_HEADS, ATTN_KV_HEADS, keys - 1, keys, 64, 1e7, 1e-6)
        split = keys >= ATTN_SPLIT_MIN_KEYS
        cases.append(Case(f"attention decode {label} keys: prep" + (" (FUSED_ATTENTION_PREP off)" if split else ""),
                          "attention_prep_bf16_d256", [prep_args, *prep_inputs, q, q, cache, cache],
                          (ceil_div(ATTN_HEADS + ATTN_KV_HEADS, 8), 1, 1), (256, 1, 1), prep_bytes + 2 * q))
        if not split:  # the engine's single pass below the split: on matrix units and vector ALUs
            args = struct.pack("<7If", 1, ATTN_HEADS, ATTN_KV_HEADS, keys, keys, 0, 0, HEAD_DIM ** -0.5)
            cases.append(Case(f"attention decode {label} keys: single pass on matrix units",
                              "attention_decode_mma_bf16_d256",
                              [args, q, q, cache, cache, q], (mma_groups, 1, 1), mma_threads, 2 * cache + 3 * q))
            cases.append(Case(f"attention decode {label} keys: single pass", "attention_decode_bf16_d256",
                              [args, q, q, cache, cache, q], (packs, 1, 1), (ATTN_THREADS, 1, 1), 2 * cache + 3 * q))
            continue
        if single:
            cases.append(Case(f"attention decode {label} keys: single pass", "attention_decode_bf16_d256",
                              [struct.pack("<7If", 1, ATTN_HEADS, ATTN_KV_HEADS, keys, keys, 0, 0, HEAD_DIM ** -0.5),
                               q, q, cache, cache, q], (packs, 1, 1), (ATTN_THREADS, 1, 1), 2 * cache + 3 * q))
        blocks = attention_split_blocks(keys)
        args = struct.pack("<7If", 1, ATTN_HEADS, ATTN_KV_HEADS, keys, keys, 0, blocks, HEAD_DIM ** -0.5)
        partial_out, partial_stats = f32(ATTN_HEADS * blocks * HEAD_DIM), f32(ATTN_HEADS * blocks * 2)
        cases.append(Case(f"attention decode {label} keys: prep + partials on matrix units ({blocks} blocks)",
                          "attention_decode_partial_prep_mma_bf16_d256",
                          [args, prep_args, *prep_inputs, q, cache, cache, partial_out, partial_stats],
                          (mma_groups, blocks, 1), mma_threads,
                          2 * cache + prep_bytes + q + partial_out + partial_stats))
        cases.append(Case(f"attention decode {label} keys: partials on matrix units ({blocks} blocks)",
                          "attention_decode_partial_mma_bf16_d256",
                          [args, q, cache, cache, partial_out, partial_stats],
                          (ceil_div(ATTN_HEADS, ATTN_MMA_HEADS_PER_GROUP), blocks, 1),
                          (32 * ATTN_DECODE_MMA_SIMDGROUPS, 1, 1),
                          2 * cache + q + partial_out + partial_stats))
        cases.append(Case(f"attention decode {label} keys: partials ({blocks} blocks)",
                          "attention_decode_partial_bf16_d256",
                          [args, q, cache, cache, partial_out, partial_stats], (packs, blocks, 1), (ATTN_THREADS, 1, 1),
                          2 * cache + q + partial_out + partial_stats))
        cases.append(Case(f"attention decode {label} keys: combine ({blocks} blocks)",
                          "attention_decode_combine_bf16_d256", [args, q, partial_out, partial_stats, q],
                          (ATTN_HEADS, HEAD_DIM // ATTN_COMBINE_SLICE, 1), (ATTN_COMBINE_THREADS, 1, 1),
                          partial_out + partial_stats + 2 * q))
    return cases


def gated_delta_case() -> Case:
    """One DeltaNet layer's decode step (conv, L2 norms, gates, delta rule, gated RMSNorm): the fp32 state is read
    and written once."""
    c, v = GDN_CONV_CHANNELS, GDN_V_HEADS * GDN_V_DIM
    state = f32(GDN_V_HEADS * GDN_V_DIM * GDN_K_DIM)
    rows = (GDN_V_HEADS // GDN_K_HEADS) * GDN_V_DIM
    buffers = [struct.pack("<IIIIffII", 1, GDN_K_HEADS, GDN_V_HEADS, GDN_V_DIM, EPS, EPS, 0, 0),
               bf16(c), bf16(v), bf16(GDN_V_HEADS), bf16(GDN_V_HEADS), bf16(c * CONV_K), f32(GDN_V_HEADS),
               f32(GDN_V_HEADS), bf16(GDN_V_DIM), bf16((CONV_K - 1) * c), state, bf16(v)]
    moved = (bf16(c) + 2 * bf16(v) + 2 * bf16(GDN_V_HEADS) + bf16(c * CONV_K) + 2 * f32(GDN_V_HEADS) +
             bf16(GDN_V_DIM) + 2 * bf16((CONV_K - 1) * c) + 2 * state)
    return Case("gated_delta_step (one DeltaNet layer)", "gated_delta_step_bf16_dk128", buffers, (GDN_K_HEADS, 1, 1),
                (32 * ceil_div(rows, GDN_ROWS_PER_SIMDGROUP), 1, 1), moved)


def spread_deltanet_cases() -> list[Case]:
    """The spread decode step of one DeltaNet layer (tuning::spread_deltanet_step, CUDA): the in_proj GEMV with the
    conv in its epilogue, the recurrence on the prefill scan's (value head, 32 rows) threadgroups at one token, and
    the out_proj GEMV with the gated norm in its staging (SiLU(z) from the first): the three dispatches that replace
    gated_delta_step's and its two GEMVs."""
    c, v = GDN_CONV_CHANNELS, GDN_V_HEADS * GDN_V_DIM
    rows = [c, v, GDN_V_HEADS, GDN_V_HEADS]
    projections = qmv_norm_seg_case("", rows, HIDDEN, staged=True)
    conv = [bf16(c * CONV_K), bf16((CONV_K - 1) * c), f32(c), f32(v)]  # weight, state, outputs, SiLU(z)
    state = f32(GDN_V_HEADS * GDN_V_DIM * GDN_K_DIM)
    slice_rows = GDN_PREFILL_SHAPE["rows_per_threadgroup"]
    scan_threads = 32 * ceil_div(slice_rows, GDN_PREFILL_SHAPE["rows_per_simdgroup"])
    w, sc = quantized(HIDDEN, v)
    grid, threads = _qmv_grid(HIDDEN, 1, staged=True)
    out_proj = [struct.pack("<IIIf", v, HIDDEN, GDN_V_DIM, EPS), f32(v), f32(v), bf16(GDN_V_DIM), w, sc, sc,
                bf16(HIDDEN), Same(7)]
    out_proj_bytes = w + 2 * sc + 2 * f32(v) + bf16(GDN_V_DIM) + 2 * bf16(HIDDEN)
    return [
        Case("spread DeltaNet step: in_proj qkv|z|b|a + conv", "qmv_norm_seg_conv_staged_q4_g64_bf16",
             projections.buffers + conv, (min(projections.grid[0], QMV_CONV_STREAM_GROUPS), 1, 1), projections.threads,
             projections.bytes_moved - bf16(c) + conv[0] + 2 * conv[1] + conv[2] + conv[3]),
        Case("spread DeltaNet step: scan of one token", "gated_delta_prefill_bf16_dk128",
             [struct.pack("<IIIIffII", 1, GDN_K_HEADS, GDN_V_HEADS, GDN_V_DIM, EPS, EPS, 0, 0), f32(c),
              bf16(GDN_V_HEADS), bf16(GDN_V_HEADS), f32(GDN_V_HEADS), f32(GDN_V_HEADS), state, f32(v)],
             (GDN_V_HEADS, ceil_div(GDN_V_DIM, slice_rows), 1), (scan_threads, 1, 1),
             f32(c) + 2 * bf16(GDN_V_HEADS) + 2 * f32(GDN_V_HEADS) + 2 * state + f32(v)),
        Case("spread DeltaNet step: out_proj + gated norm", "qmv_gated_norm_residual_staged_q4_g64_bf16", out_proj,
             grid, (threads[0], step_slots(v), 1), out_proj_bytes),
        Case("spread DeltaNet step: out_proj + gated norm, one step slot", "qmv_gated_norm_residual_staged_q4_g64_bf16",
             out_proj, grid, threads, out_proj_bytes, "SPLIT_STEPS off"),
    ]


def sampling_cases() -> list[Case]:
    partials = ceil_div(VOCAB, ARGMAX_BLOCK)
    args = struct.pack("<IIII", VOCAB, ARGMAX_BLOCK, partials, 0)
    return [
        Case("argmax over 248,320 logits: partials", "argmax_partial_f32",
             [args, f32(VOCAB), f32(partials), f32(partials)], (partials, 1, 1), (ARGMAX_THREADS, 1, 1),
             f32(VOCAB) + 2 * f32(partials)),
        Case("argmax over 248,320 logits: final", "argmax_final_f32",
             [args, f32(partials), f32(partials), f32(4)], (1, 1, 1), (ARGMAX_THREADS, 1, 1), 2 * f32(partials) + 4),
        Case(f"argmax final over the greedy lm_head's {QMV_STREAM_GROUPS} partials (FUSED_ARGMAX)", "argmax_final_f32",
             [struct.pack("<IIII", VOCAB, ARGMAX_BLOCK, QMV_STREAM_GROUPS, 0), f32(QMV_STREAM_GROUPS),
              f32(QMV_STREAM_GROUPS), f32(4)], (1, 1, 1), (ARGMAX_THREADS, 1, 1), 2 * f32(QMV_STREAM_GROUPS) + 4),
        Case("sample over 248,320 logits (T 0.7, top-k 50, top-p 0.9)", "sample_f32",
             [struct.pack("<IIfffIIIIIII", VOCAB, 50, 0.7, 0.9, 0.0, 1234, 0, 0, 0, 0, 0, 0), f32(VOCAB), f32(4)],
             (1, 1, 1), (SAMPLE_THREADS, 1, 1), f32(VOCAB) + 4),
        *sample_block_cases(),
    ]


def sample_block_cases() -> list[Case]:
    """The block path (sample_partial + sample_final), sample_final reading the exact stage-1 outputs of its logits:
    T 0.7 with top-k 50 + top-p 0.9, with plain temperature, and with top-p 0.9 alone, over peaked logits (3 sigma
    before the temperature: the candidates hold the nucleus); and top-p 0.9 alone over flat logits (0.3 sigma: the
    nucleus reaches below blocks' 64th value, so sample_final takes the general path over the vocabulary), beside
    sample_f32 (what such requests ran before) and sample_final at 1024 threads."""
    from lily.kernel_cases.sampling import partial_reference  # the reference of sample_partial's outputs

    blocks = ceil_div(VOCAB, SAMPLE_BLOCK)
    rng = np.random.default_rng(5)
    cases = []
    for spread, settings in ((3.0, (("T 0.7, top-k 50, top-p 0.9", 50, 0.9), ("T 0.7, top-k off, top-p 1", 0, 1.0),
                                     ("T 0.7, top-k off, top-p 0.9", 0, 0.9))),
                             (0.3, (("flat, T 0.7, top-k off, top-p 0.9", 0, 0.9),))):
        logits = (spread * rng.standard_normal(VOCAB)).astype(np.float32)
        x = (logits / np.float32(0.7)).astype(np.float32)
        cand_x, cand_id, stats, cuts = partial_reference(x, SAMPLE_BLOCK)
        stage1 = [cand_x.tobytes(), cand_id.tobytes(), stats.astype(np.float32).tobytes(), cuts.tobytes()]
        for what, top_k, top_p in settings:
            args = struct.pack("<IIfffIIIIIII", VOCAB, top_k, 0.7, top_p, 0.0, 1234, 0, 0, 0, SAMPLE_BLOCK, blocks, 0)
            plain = top_k == 0 and top_p == 1.0
            if top_k == 0 and top_p < 1.0:
                cases.append(Case(f"sample over 248,320 logits ({what})", "sample_f32",
                                  [struct.pack("<IIfffIIIIIII", VOCAB, 0, 0.7, top_p, 0.0, 1234, 0, 0, 0, 0, 0, 0),
                                   logits.tobytes(), f32(4)], (1, 1, 1), (SAMPLE_THREADS, 1, 1), f32(VOCAB) + 4))
            written = (0 if plain else 2 * f32(blocks * SAMPLE_CANDIDATES)) + 2 * f32(blocks * 2)
            if spread > 1.0:
                cases.append(Case(f"sample block path over 248,320 logits ({what}): partials", "sample_partial_f32",
                                  [args, logits.tobytes(), f32(blocks * SAMPLE_CANDIDATES),
                                   f32(blocks * SAMPLE_CANDIDATES), f32(blocks * 2), f32(blocks * 2)],
                                  (blocks, 1, 1), (SAMPLE_PARTIAL_THREADS, 1, 1), f32(VOCAB) + written))
            read = f32(blocks * 2) + (f32(SAMPLE_BLOCK) if plain else 2 * f32(blocks * SAMPLE_CANDIDATES))
            threads = (SAMPLE_FINAL_THREADS, SAMPLE_THREADS) if top_k == 0 and top_p < 1.0 else (SAMPLE_FINAL_THREADS,)
            for n in threads:
                at = "" if n == SAMPLE_FINAL_THREADS else f", {n} threads"
                cases.append(Case(f"sample block path over 248,320 logits ({what}): final{at}", "sample_final_f32",
                                  [args, logits.tobytes(), *stage1, f32(4)], (1, 1, 1), (n, 1, 1), read + 4))
    return cases


def qmv_cases() -> list[Case]:
    """qmv at every decode projection shape and lm_head (plain qmv at M = 1, 2, 4, 8: the 8-row case runs as two
    4-row threadgroup rows, and as the 16-row qmm tile the host picks for M > 4 at N >= 8192), then the fused variants
    the decode step dispatches."""
    shapes = [("lm_head", VOCAB, HIDDEN), ("square", 2048, HIDDEN),
              ("DeltaNet in_proj_qkv / attention q_proj", 8192, HIDDEN), ("DeltaNet in_proj_z", 4096, HIDDEN),
              ("DeltaNet out_proj / attention o_proj", HIDDEN, 4096), ("attention k_proj / v_proj", 512, HIDDEN)]
    cases = []
    for name, n, k in shapes:
        for m in (1, 2, 4, 8):
            cases.append(qmv_case(f"qmv {name} {n}x{k}, M={m}", n, k, m))
        for m in (1, 2, 4, 8):
            cases.append(qmv_mma_case(f"qmv_mma {name} {n}x{k}, M={m}", n, k, m))
    cases.append(qmv_mma_case(f"qmv_mma lm_head {VOCAB}x{HIDDEN}, M=1, f32 logits", VOCAB, HIDDEN, 1, f32_out=True))
    cases.append(qmv_case(f"qmv router 256x{HIDDEN} 8-bit, M=1", EXPERTS, HIDDEN, 1, bits=8))
    cases.append(qmm_case(f"qmm bm16 lm_head {VOCAB}x{HIDDEN}, M=8", VOCAB, HIDDEN, 8))
    cases.append(qmm_case(f"qmm bm16 2048x{HIDDEN}, M=8", 2048, HIDDEN, 8))
    # The fused variants the decode step dispatches: unstaged (Metal's) and staged (CUDA's, tuning::staged_gemv).
    for staged in (False, True):
        tag = " (staged)" if staged else ""
        cases.append(qmv_norm_case(f"qmv_norm lm_head {VOCAB}x{HIDDEN} (final norm folded in, f32 logits){tag}", VOCAB,
                                   HIDDEN, staged=staged))
        if staged:  # the greedy step's lm_head on CUDA (FUSED_ARGMAX): against the row above and argmax_partial
            cases.append(qmv_norm_case(f"qmv_norm lm_head {VOCAB}x{HIDDEN} + argmax partials (greedy){tag}", VOCAB,
                                       HIDDEN, staged=True, argmax=True))
        cases.append(qmv_norm_seg_case(f"qmv_norm_seg DeltaNet in_proj qkv|z|b|a{tag}",
                                       [GDN_CONV_CHANNELS, GDN_V_HEADS * GDN_V_DIM, GDN_V_HEADS, GDN_V_HEADS], HIDDEN,
                                       staged=staged))
        cases.append(qmv_norm_seg_case(f"qmv_norm_seg attention q|k|v{tag}",
                                       [2 * ATTN_HEADS * HEAD_DIM, ATTN_KV_HEADS * HEAD_DIM,
                                        ATTN_KV_HEADS * HEAD_DIM], HIDDEN, staged=staged))
        cases.append(qmv_norm_seg_case(f"qmv_norm_seg router|shared gate 8-bit, f32 out{tag}", [EXPERTS, 1], HIDDEN,
                                       bits=8, f32_out=True, staged=staged))
        if staged:
            cases.append(qmv_norm_seg_case(f"qmv_norm_seg router|shared gate 8-bit, f32 out{tag}, one step slot",
                                           [EXPERTS, 1], HIDDEN, bits=8, f32_out=True, staged=True, split=False,
                                           note="SPLIT_STEPS off"))
        cases.append(qmv_residual_case(f"qmv_residual out_proj / o_proj 2048x4096{tag}", HIDDEN, 4096,
                                       staged=staged))
        if staged:
            cases.append(qmv_residual_case(f"qmv_residual out_proj / o_proj 2048x4096{tag}, one step slot", HIDDEN,
                                           4096, staged=True, split=False, note="SPLIT_STEPS off"))
    return cases


# ---- prefill GEMMs (the issue-20 shapes): dense qmm and the grouped MoE GEMM over a routed chunk ----

MOE_GEMM_BN, MOE_GEMM_THREADS, MOE_BM32_MIN_ROWS_PER_EXPERT = 64, 128, 16


def qmm_tile_rows(m: int, n: int) -> int:
    """The host's bf16 rule (tuning::qmm_tile_rows)."""
    if m <= QMM_BM16:
        return 16
    return 64 if ceil_div(n, QMM_BN) * ceil_div(m, 64) >= QMM_MIN_THREADGROUPS else 32


def qmm_prefill_case(label: str, n: int, k: int, m: int) -> Case:
    w, s = quantized(n, k)
    bm = qmm_tile_rows(m, n)
    return Case(label, f"qmm_q4_g64_bf16_bm{bm}", [struct.pack("<IIII", k, n, m, 0), bf16(m * k), w, s, s,
                bf16(m * n)], (ceil_div(n, QMM_BN), ceil_div(m, bm), 1), (QMM_THREADS, 1, 1),
                w + 2 * s + bf16(m * k) + bf16(m * n), flops=2 * m * n * k)


def _routing(tokens: int, bm: int, seed: int = 5) -> tuple[bytes, bytes, bytes, int]:
    """sorted_pairs, tile_map, tile_count and max_tiles of `tokens` rows routed to TOP_K distinct uniformly random
    experts each: the block map moe_sort_scan builds (expert-contiguous pairs, ascending within an expert)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K].reshape(-1)
    pairs = np.argsort(ids, kind="stable").astype(np.uint32)
    counts = np.bincount(ids, minlength=EXPERTS)
    max_tiles = ceil_div(tokens * TOP_K, bm) + min(EXPERTS, tokens * TOP_K)
    tiles, first = [], 0
    for e, count in enumerate(counts):
        for r in range(0, count, bm):
            tiles.append((e, first + r, min(bm, count - r), 0))
        first += count
    tile_map = np.zeros((max_tiles, 4), np.uint32)
    tile_map[:len(tiles)] = tiles
    return pairs.tobytes(), tile_map.tobytes(), struct.pack("<4I", len(tiles), 0, 0, 0), max_tiles


def moe_prefill_cases(tokens: int, bm: int | None = None) -> list[Case]:
    """The grouped gate/up and down GEMMs over a routed chunk, with the host's tile rows or `bm`."""
    host_bm = 32 if tokens * TOP_K / EXPERTS >= MOE_BM32_MIN_ROWS_PER_EXPERT else 16
    note = "" if bm in (None, host_bm) else f"bm{bm}: not the host's choice"
    bm = bm or host_bm
    pairs, tile_map, tile_count, max_tiles = _routing(tokens, bm)
    rows = tokens * TOP_K
    args = struct.pack("<8I", tokens, EXPERTS, TOP_K, HIDDEN, EXPERT_SIZE, SHARED_SIZE, bm, max_tiles)
    ew, es = quantized(EXPERTS * EXPERT_SIZE, HIDDEN)
    dw, ds = quantized(EXPERTS * HIDDEN, EXPERT_SIZE)
    gate_up = Case(f"moe_gemm gate/up+SwiGLU, T={tokens} bm{bm} (8 of 256 experts per row)",
                   f"moe_gemm_gate_up_bf16_bm{bm}",
                   [args, bf16(tokens * HIDDEN), pairs, tile_map, tile_count, ew, es, es, ew, es, es,
                    bf16(rows * EXPERT_SIZE)], (ceil_div(EXPERT_SIZE, MOE_GEMM_BN), max_tiles, 1),
                   (MOE_GEMM_THREADS, 1, 1), 2 * (ew + 2 * es) + bf16(tokens * HIDDEN) + bf16(rows * EXPERT_SIZE),
                   note, flops=2 * rows * 2 * EXPERT_SIZE * HIDDEN)
    down = Case(f"moe_gemm down, T={tokens} bm{bm}", f"moe_gemm_down_bf16_bm{bm}",
                [args, bf16(rows * EXPERT_SIZE), pairs, tile_map, tile_count, f32(rows), dw, ds, ds,
                 bf16(rows * HIDDEN)], (ceil_div(HIDDEN, MOE_GEMM_BN), max_tiles, 1), (MOE_GEMM_THREADS, 1, 1),
                dw + 2 * ds + bf16(rows * EXPERT_SIZE) + bf16(rows * HIDDEN), note,
                flops=2 * rows * HIDDEN * EXPERT_SIZE)
    return [gate_up, down]


GDN_PREFILL_SHAPE = {"rows_per_threadgroup": 32, "rows_per_simdgroup": 1}  # LILY_GDN_PREFILL_ROWS_PER_*
GDN_CONV_THREADS, GDN_PREFILL_NORM_THREADS = 256, 256  # tuning::kGdnConvThreads, kGdnPrefillNormThreads
GDN_CONV_TOKENS = 16  # LILY_GDN_CONV_TOKENS


def gated_delta_prefill_cases(tokens: int) -> list[Case]:
    """One DeltaNet layer's prefill of a chunk: the conv, the scan (state rows split over threadgroups), the norm."""
    c, v = GDN_CONV_CHANNELS, GDN_V_HEADS * GDN_V_DIM
    args = struct.pack("<IIIIffII", tokens, GDN_K_HEADS, GDN_V_HEADS, GDN_V_DIM, EPS, EPS, 0, 0)
    state = f32(GDN_V_HEADS * GDN_V_DIM * GDN_K_DIM)
    rows, rows_per_simdgroup = GDN_PREFILL_SHAPE["rows_per_threadgroup"], GDN_PREFILL_SHAPE["rows_per_simdgroup"]
    slices = ceil_div(GDN_V_DIM, rows)
    scan_threads = 32 * ceil_div(rows, rows_per_simdgroup)
    norm_rows = tokens * GDN_V_HEADS
    return [
        Case(f"gated_delta_conv, T={tokens}", "gated_delta_conv_bf16_dk128",
             [args, bf16(tokens * c), bf16(c * CONV_K), bf16((CONV_K - 1) * c), f32(tokens * c)],
             (ceil_div(c, GDN_CONV_THREADS), ceil_div(tokens, GDN_CONV_TOKENS), 1), (GDN_CONV_THREADS, 1, 1),
             bf16(tokens * c) + f32(tokens * c) + bf16(c * CONV_K) + bf16((CONV_K - 1) * c)),
        Case(f"gated_delta_conv_state, T={tokens}", "gated_delta_conv_state_bf16_dk128",
             [args, bf16(tokens * c), bf16((CONV_K - 1) * c)], (ceil_div(c, GDN_CONV_THREADS), 1, 1),
             (GDN_CONV_THREADS, 1, 1), 3 * bf16((CONV_K - 1) * c)),
        Case(f"gated_delta_prefill scan, T={tokens}", "gated_delta_prefill_bf16_dk128",
             [args, f32(tokens * c), bf16(tokens * GDN_V_HEADS), bf16(tokens * GDN_V_HEADS), f32(GDN_V_HEADS),
              f32(GDN_V_HEADS), state, f32(tokens * v)], (GDN_V_HEADS, slices, 1), (scan_threads, 1, 1),
             f32(tokens * c) + 2 * state + f32(tokens * v)),
        Case(f"gated_delta_prefill_norm, T={tokens}", "gated_delta_prefill_norm_bf16",
             [args, f32(tokens * v), bf16(tokens * v), bf16(GDN_V_DIM), bf16(tokens * v)],
             (ceil_div(norm_rows, GDN_PREFILL_NORM_THREADS // 32), 1, 1), (GDN_PREFILL_NORM_THREADS, 1, 1),
             f32(tokens * v) + 2 * bf16(tokens * v)),
    ]


GDN_CHUNK, GDN_CHUNK_SCAN_SIMDGROUPS = 32, 2  # LILY_GDN_CHUNK, LILY_GDN_CHUNK_SCAN_SIMDGROUPS
GDN_CHUNK_PREPARE_THREADS = 256  # tuning::kGdnChunkPrepareThreads


def gated_delta_chunk_cases(tokens: int) -> list[Case]:
    """The chunked DeltaNet scan of one layer's chunk (what the host runs for 64+ tokens with CHUNKED_SCAN on):
    gated_delta_chunk_prepare (one threadgroup per value head and 32-token chunk) and gated_delta_chunk_scan (8 state
    rows per simdgroup, sequential over the chunks); with the token scan at 4096 tokens for comparison (the 512-token
    one is in gated_delta_prefill_cases)."""
    c, v = GDN_CONV_CHANNELS, GDN_V_HEADS * GDN_V_DIM
    args = struct.pack("<IIIIffII", tokens, GDN_K_HEADS, GDN_V_HEADS, GDN_V_DIM, EPS, EPS, 0, 0)
    state = f32(GDN_V_HEADS * GDN_V_DIM * GDN_K_DIM)
    blocks, nb, dk, dv = GDN_V_HEADS * ceil_div(tokens, GDN_CHUNK), GDN_CHUNK // 8, GDN_K_DIM, GDN_V_DIM
    keys, values, pairs = f32(blocks * GDN_CHUNK * dk), f32(blocks * GDN_CHUNK * dv), f32(blocks * GDN_CHUNK**2)
    operands = [keys, values, keys, keys, pairs, f32(blocks)]  # W, U, Qg, KdT, M, gamma_last
    scratch = sum(operands)
    lower = nb * (nb + 1) // 2 * 8 * 8  # elements of the 8x8 blocks on and below a chunk's diagonal
    prepare_macs = blocks * (2 * lower * dk + lower * (dk + dv))  # Gram matrices; Tinv x [K | V]
    scan_macs = blocks * (2 * GDN_CHUNK * dk * dv + lower * dv + dk * GDN_CHUNK * dv)  # W S^T, Qg S^T; M V'; KdT V'
    rows = 8 * GDN_CHUNK_SCAN_SIMDGROUPS
    cases = [
        Case(f"gated_delta_chunk_prepare, T={tokens}", "gated_delta_chunk_prepare_bf16_dk128",
             [args, f32(tokens * c), bf16(tokens * GDN_V_HEADS), bf16(tokens * GDN_V_HEADS), f32(GDN_V_HEADS),
              f32(GDN_V_HEADS), *operands], (GDN_V_HEADS, ceil_div(tokens, GDN_CHUNK), 1),
             (GDN_CHUNK_PREPARE_THREADS, 1, 1), f32(tokens * c) + scratch, flops=2 * prepare_macs),
        Case(f"gated_delta_chunk_scan, T={tokens}", "gated_delta_chunk_scan_bf16_dk128",
             [args, *operands, state, f32(tokens * v)], (GDN_V_HEADS, ceil_div(GDN_V_DIM, rows), 1),
             (32 * GDN_CHUNK_SCAN_SIMDGROUPS, 1, 1), scratch + 2 * state + f32(tokens * v), flops=2 * scan_macs),
    ]
    if tokens != 512:
        cases.append(gated_delta_prefill_cases(tokens)[2])  # the token scan at the same length
    return cases


def attention_prefill_cases(tokens: int = 512) -> list[Case]:
    """Prefill attention of one chunk of `tokens` queries (the engine's chunk) over a bf16 KV cache: the first chunk
    (as many keys as queries) and one after 4096 tokens of context. FLOPs count the causal pairs only (query t at
    position keys - T + t sees position + 1 keys; 2·D each for Q·K^T and for P·V), not the masked ones the kernel
    also multiplies on the diagonal."""
    q = bf16(tokens * ATTN_HEADS * HEAD_DIM)
    grid = (ceil_div(tokens, ATTN_MMA_QUERIES), ATTN_HEADS // ATTN_MMA_HEADS_PER_GROUP, 1)
    cases = []
    for context in (0, 4096):
        keys = context + tokens
        cache = bf16(ATTN_KV_HEADS * keys * HEAD_DIM)
        pairs = tokens * context + tokens * (tokens + 1) // 2
        args = struct.pack("<7If", tokens, ATTN_HEADS, ATTN_KV_HEADS, keys, keys, 0, 0, HEAD_DIM ** -0.5)
        cases.append(Case(f"attention_prefill_mma T={tokens}, {keys} keys", "attention_prefill_mma_bf16_d256",
                          [args, q, q, cache, cache, q], grid, (32 * ATTN_MMA_HEADS_PER_GROUP, 1, 1),
                          2 * cache + 3 * q, flops=4 * HEAD_DIM * pairs * ATTN_HEADS))
    return cases


def short_prompt_cases() -> list[Case]:
    """The projections of a short prompt (5 to 8 rows, above qmv's one-pass row limit) as qmv (weights read once per
    4 rows) and as the 16-row qmm tile: which one the kernel choice should take at each shape."""
    shapes = [("DeltaNet in_proj_qkv / attention q_proj", 8192, HIDDEN, 4, False),
              ("DeltaNet in_proj_z", 4096, HIDDEN, 4, False),
              ("DeltaNet in_proj_b / in_proj_a", GDN_V_HEADS, HIDDEN, 4, False),
              ("DeltaNet out_proj / attention o_proj", HIDDEN, 4096, 4, False),
              ("attention k_proj / v_proj", 512, HIDDEN, 4, False),
              ("router 8-bit, f32 out", EXPERTS, HIDDEN, 8, True),
              ("shared-expert gate 8-bit, f32 out", 1, HIDDEN, 8, True)]
    cases = []
    for name, n, k, bits, f32_out in shapes:
        for m in (5, 8):
            cases.append(qmv_case(f"short prompt qmv {name} {n}x{k}, M={m}", n, k, m, bits, f32_out))
            cases.append(qmm_case(f"short prompt qmm bm16 {name} {n}x{k}, M={m}", n, k, m, bits, f32_out))
            if bits == 4:
                cases.append(qmv_mma_case(f"short prompt qmv_mma {name} {n}x{k}, M={m}", n, k, m, f32_out))
    cases.extend(moe_prefill_cases(8, bm=16))
    return cases


def prefill_cases() -> list[Case]:
    cases = attention_prefill_cases()
    for m in (512, 4096):
        cases.append(qmm_prefill_case(f"qmm DeltaNet in_proj_qkv 8192x{HIDDEN}, M={m}", 8192, HIDDEN, m))
        cases.append(qmm_prefill_case(f"qmm out_proj 2048x4096, M={m}", HIDDEN, 4096, m))
        cases.extend(moe_prefill_cases(m))
    cases.extend(moe_prefill_cases(512, bm=16))
    cases.extend(gated_delta_prefill_cases(512))
    for tokens in (512, 4096):
        cases.extend(gated_delta_chunk_cases(tokens))
    return cases


def cases() -> list[Case]:
    found = [rms_norm_case(), embedding_case(), *qmv_cases(), *moe_cases(), *attention_cases(), gated_delta_case(),
             *spread_deltanet_cases(), *sampling_cases(), *short_prompt_cases(), *prefill_cases()]
    for c in found:
        if "_staged_" in c.kernel:
            c.kernel += STAGED_LOADS["suffix"]
    return found


# ---- argument checks without a GPU: the <kernel>_msl_params tables of the PTX files ----

_PARAMS_RE = re.compile(r"\.b8 (\w+)_msl_params\[(\d+)\] = \{([\d,\s]+)\}")


def ptx_parameter_tables(ptx: Path) -> dict[str, list[tuple[int, int, int, int]]]:
    """{kernel: [(attribute, index, binding, size)]} read from the PTX text (the table lily.cuda reads on the GPU)."""
    tables = {}
    for f in sorted(ptx.glob("*.ptx")):
        for name, size, data in _PARAMS_RE.findall(f.read_text()):
            raw = bytes(int(b) for b in data.split(","))  # PTX leaves out the trailing zero bytes
            words = np.frombuffer(raw + bytes(int(size) - len(raw)), np.uint32)
            tables[name] = [tuple(int(v) for v in words[1 + 4 * i: 5 + 4 * i]) for i in range(words[0])]
    return tables


def check_case(c: Case, table: list[tuple[int, int, int, int]] | None) -> None:
    """The launch rules lily.cuda applies, before any GPU work: every [[buffer(i)]] bound, setBytes data exactly its
    struct, a buffer at least its element."""
    if table is None:
        raise ValueError(f"{c.label}: no kernel {c.kernel} in the PTX files")
    if c.threads[0] * c.threads[1] * c.threads[2] > 1024 or min(c.grid + c.threads) < 1:
        raise ValueError(f"{c.label}: bad launch shape {c.grid} x {c.threads}")
    for attr, index, binding, size in table:
        if attr != 0:
            continue
        if index >= len(c.buffers):
            raise ValueError(f"{c.label}: {c.kernel} [[buffer({index})]] is not bound ({len(c.buffers)} buffers)")
        b = c.buffers[index]
        b = c.buffers[b.index] if isinstance(b, Same) else b
        got = len(b) if isinstance(b, bytes) else b
        if binding == 1 and (got != size if isinstance(b, bytes) else got < size):
            raise ValueError(f"{c.label}: {c.kernel} [[buffer({index})]] expects {size} bytes; got {got}")


# ---- timing ----

class Filler:
    """Fills device buffers with finite bf16-range values in [2^-7, 1) (as f32 too: each pair of halves is a float in
    that range) by device-to-device copies of one random block: no per-buffer host work."""

    def __init__(self, gpu: cuda.Runner, block: int = 64 << 20) -> None:
        self.gpu, self.block = gpu, block
        data = np.random.default_rng(0).integers(0x3C00, 0x3F80, size=block // 2, dtype=np.uint16)
        self.source = gpu.alloc(block)
        gpu.upload(self.source, data.tobytes())

    def fill(self, ptr: int, nbytes: int) -> None:
        for offset in range(0, nbytes, self.block):
            self.gpu.copy(ptr + offset, self.source, min(self.block, nbytes - offset))


_ENTRY_RE = re.compile(r"^\.(?:visible|weak)?\s*\.entry\s+(\w+)\s*\(", re.M)


def needed_ptx(selected: list[Case], tmp: Path) -> Path:
    """A folder of links to only the PTX files that hold the selected kernels: the driver JIT-compiles every module
    the Runner loads, and the prefill modules (GEMMs) would cost load time the benchmark does not use."""
    kernels = {c.kernel for c in selected}
    for f in sorted(cuda.ptx_dir().glob("*.ptx")):
        if kernels & set(_ENTRY_RE.findall(f.read_text())):
            (tmp / f.name).symlink_to(f.resolve())
    return tmp


def run(args: argparse.Namespace, selected: list[Case]) -> list[dict]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = needed_ptx(selected, Path(tmp))
        files = sorted(f.name for f in folder.iterdir())
        gpu = cuda.Runner(folder)  # reads the files now
    print(f"loaded {', '.join(files)} in {time.perf_counter() - started:.1f} s", flush=True)
    flush_bytes = 512 << 20  # several times the H200's 60 MB L2
    flush = gpu.alloc(flush_bytes)
    copy_bytes = 1 << 30
    src, dst = gpu.alloc(copy_bytes), gpu.alloc(copy_bytes)
    copy_ms = statistics.median(gpu.time_ms(lambda: gpu.copy(dst, src, copy_bytes), args.repeats, flush, flush_bytes))
    copy_gbs = 2 * copy_bytes / copy_ms / 1e6  # read + write
    gpu.free(src)
    gpu.free(dst)
    filler = Filler(gpu)
    same_size_copy_us: dict[int, float] = {}

    def same_size_copy(nbytes: int) -> float:
        """Cold-L2 median µs of a device-to-device copy moving `nbytes` (reading and writing half each)."""
        if nbytes not in same_size_copy_us:
            half = max(nbytes // 2, 1)
            a, b = gpu.alloc(half), gpu.alloc(half)
            try:
                same_size_copy_us[nbytes] = 1e3 * statistics.median(
                    gpu.time_ms(lambda: gpu.copy(b, a, half), args.repeats, flush, flush_bytes))
            finally:
                gpu.free(a)
                gpu.free(b)
        return same_size_copy_us[nbytes]

    rows = [{"case": "device-to-device copy 1 GiB", "kernel": "cuMemcpyDtoD", "us": copy_ms * 1e3,
             "gbs": copy_gbs, "fraction": 1.0, "bytes": 2 * copy_bytes, "same_size_copy_us": copy_ms * 1e3,
             "of_same_size_copy": 1.0}]
    print(f"GPU: {gpu.device_name} (sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}); copy "
          f"{copy_gbs:,.0f} GB/s", flush=True)
    failures = []
    for c in selected:
        pointers, owned = [], []
        try:
            for b in c.buffers:
                if isinstance(b, Same):
                    pointers.append(pointers[b.index])
                    continue
                p = gpu.alloc(len(b) if isinstance(b, bytes) else b)
                owned.append(p)
                if isinstance(b, bytes):
                    gpu.upload(p, b)
                else:
                    filler.fill(p, b)
                pointers.append(p)
            launch = lambda: gpu.launch(c.kernel, pointers, c.grid, c.threads)  # noqa: E731
            gpu.synchronize(c.kernel)
            warm_ms = statistics.median(gpu.time_ms(launch, args.repeats))
            ms = statistics.median(gpu.time_ms(launch, args.repeats, flush, flush_bytes))
            gpu.synchronize(c.kernel)
        except (cuda.CudaError, ValueError) as exc:
            failures.append(f"{c.label}: {exc}")
            print(f"FAILED {c.label}: {exc}", file=sys.stderr, flush=True)
            if isinstance(exc, cuda.CudaError):
                break  # the context may be unusable after a kernel fault
            continue
        finally:
            for p in owned:
                try:
                    gpu.free(p)
                except cuda.CudaError:
                    pass
        gbs = c.bytes_moved / ms / 1e6
        copy_us = same_size_copy(c.bytes_moved)
        rows.append({"case": c.label, "kernel": c.kernel, "us": ms * 1e3, "warm_us": warm_ms * 1e3, "gbs": gbs,
                     "fraction": gbs / copy_gbs, "bytes": c.bytes_moved, "same_size_copy_us": copy_us,
                     "of_same_size_copy": copy_us / (ms * 1e3), "note": c.note})
        if c.flops:
            rows[-1]["tflops"] = c.flops / ms / 1e9
    print(f"median of {args.repeats} CUDA-event timings, L2 flushed ({flush_bytes >> 20} MiB written) before each")
    print("| case | kernel | µs (cold L2) | µs (warm) | bytes | GB/s | fraction of copy | same-size copy µs | "
          "of same-size copy | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        warm = f"{r['warm_us']:.1f}" if "warm_us" in r else ""
        tflops = f"{r['tflops']:.1f}" if "tflops" in r else ""
        print(f"| {r['case']} | `{r['kernel']}` | {r['us']:.1f} | {warm} | {r['bytes']:,} | {r['gbs']:,.0f} | "
              f"{r['fraction']:.2f} | {r['same_size_copy_us']:.1f} | {r['of_same_size_copy']:.2f} | {tflops} |")
    by_case = {r["case"]: r["us"] for r in rows}
    for name in (f"lm_head {VOCAB}x{HIDDEN}", f"square 2048x{HIDDEN}"):
        one, four = by_case.get(f"qmv {name}, M=1"), by_case.get(f"qmv {name}, M=4")
        if one and four:
            print(f"qmv {name}: M=4 costs {four / one:.2f}x M=1")
    if failures:
        print(f"bench_kernels: {len(failures)} case(s) failed:\n" + "\n".join(failures), file=sys.stderr)
        raise SystemExit(1)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timings per case and L2 state (default 20)")
    parser.add_argument("--kernels", help="only cases whose label or kernel matches REGEX")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the cases; with PTX files (LILY_CUDA_PTX_DIR), check every case's arguments "
                             "against its kernel's parameter table; no GPU needed")
    parser.add_argument("--gdn-prefill-rows", nargs=2, type=int, metavar=("PER_THREADGROUP", "PER_SIMDGROUP"),
                        help="the LILY_GDN_PREFILL_ROWS_PER_* values the PTX was built with (default 32 1)")
    parser.add_argument("--qmv-shape", nargs=3, type=int, metavar=("ROWS", "SIMDGROUPS", "BATCH"),
                        help="the LILY_QMV_* values the PTX was built with (default 4 2 4)")
    parser.add_argument("--qmv-staged", type=int, metavar="SIMDGROUPS",
                        help="simdgroups per threadgroup of the staged GEMVs (LILY_QMV_STAGED_SIMDGROUPS, default 4)")
    parser.add_argument("--qmv-mma", nargs=2, type=int, metavar=("ROWS", "SIMDGROUPS"),
                        help="the LILY_QMV_MMA_ROWS value the PTX was built with (default 16) and simdgroups for "
                             "every qmv_mma case (default: the engine's, 8 below 8192 outputs, else 4)")
    parser.add_argument("--word-loads", action="store_true",
                        help="time the staged kernels' word-load instances (codes off 16 bytes) instead of _a16")
    args = parser.parse_args(argv)
    if args.word_loads:
        STAGED_LOADS["suffix"] = ""
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.qmv_shape:
        QMV_SHAPE.update(zip(("rows_per_simdgroup", "simdgroups", "batch"), args.qmv_shape))
    if args.qmv_staged:
        QMV_STAGED["simdgroups"] = args.qmv_staged
    if args.qmv_mma:
        QMV_MMA.update(zip(("rows", "simdgroups"), args.qmv_mma))
    if args.gdn_prefill_rows:
        GDN_PREFILL_SHAPE.update(zip(("rows_per_threadgroup", "rows_per_simdgroup"), args.gdn_prefill_rows))
    selected = [c for c in cases() if not args.kernels or re.search(args.kernels, c.label)
                or re.search(args.kernels, c.kernel)]
    if not selected:
        parser.error(f"no case matches {args.kernels!r}")
    if args.dry_run:
        ptx = cuda.ptx_dir()
        tables = ptx_parameter_tables(ptx) if ptx.is_dir() else {}
        for c in selected:
            if tables:
                check_case(c, tables.get(c.kernel))
            print(f"{c.label}: {c.kernel} grid {c.grid} x {c.threads}, {c.bytes_moved:,} bytes")
        print(f"{len(selected)} cases; arguments " +
              (f"checked against {ptx}" if tables else f"not checked (no PTX in {ptx})"))
        return 0
    rows = run(args, selected)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
