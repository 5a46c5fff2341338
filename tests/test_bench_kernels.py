"""scripts/bench_kernels.py without a GPU: the case list covers every decode kernel and the prefill GEMM and DeltaNet
kernels (with a routing that is the block map the grouped GEMM expects), and --dry-run checks each case's
bindings against its kernel's parameter table in the PTX (as lily.cuda does before a launch), so the one H200 run
does not fail on an argument list."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tools"))
import bench_kernels  # noqa: E402
import cuda_kernels  # noqa: E402

DECODE_KERNELS = {"qmv_q4_g64_bf16", "qmv_q8_g64_bf16", "qmv_norm_q4_g64_bf16_of32", "qmv_norm_seg_q4_g64_bf16",
                  "qmv_norm_seg_q8_g64_bf16_of32", "qmv_residual_q4_g64_bf16", "qmm_q4_g64_bf16_bm16",
                  "moe_route_f32", "moe_gate_up_swiglu_bf16", "moe_gate_up_swiglu_routed_bf16",
                  "moe_down_combine_bf16", "attention_decode_bf16_d256", "attention_decode_partial_bf16_d256",
                  "attention_decode_partial_mma_bf16_d256", "attention_decode_mma_bf16_d256",
                  # ... the partials with the prep fused in (FUSED_ATTENTION_PREP), and the prep
                  "attention_decode_partial_prep_mma_bf16_d256",
                  "attention_prep_bf16_d256",
                  "attention_decode_combine_bf16_d256", "gated_delta_step_bf16_dk128", "embedding_gather_q4_g64_bf16",
                  "rms_norm_bf16", "argmax_partial_f32", "argmax_final_f32", "sample_f32",
                  "sample_partial_f32", "sample_final_f32",
                  # CUDA's choice of the one-row decode GEMVs (tuning::staged_gemv), their codes on 16 bytes as in a
                  # full-size file (tuning::whole_pack_loads)
                  "qmv_norm_staged_q4_g64_bf16_of32_a16", "qmv_norm_argmax_staged_q4_g64_bf16_of32_a16",
                  "qmv_norm_seg_staged_q4_g64_bf16_a16",
                  "qmv_norm_seg_staged_q8_g64_bf16_of32_a16", "qmv_residual_staged_q4_g64_bf16_a16",
                  # ... and of the decode experts (tuning::staged_moe)
                  "moe_gate_up_swiglu_routed_staged_bf16_a16", "moe_down_combine_staged_bf16_a16",
                  # CUDA's spread DeltaNet step (tuning::spread_deltanet_step; its scan is the prefill one's)
                  "qmv_norm_seg_conv_staged_q4_g64_bf16_a16", "qmv_gated_norm_residual_staged_q4_g64_bf16_a16"}


# The prefill cases: the GEMMs with the tiles the host picks at 512 and 4096 rows (and 16-row MoE tiles at 512 for
# comparison), the DeltaNet prefill kernels (the token scan and the chunked scan at 512 and 4096 tokens), prefill
# attention at 512 and 4608 keys.
PREFILL_KERNELS = {"qmm_q4_g64_bf16_bm32", "qmm_q4_g64_bf16_bm64", "moe_gemm_gate_up_bf16_bm16",
                   "moe_gemm_down_bf16_bm16", "moe_gemm_gate_up_bf16_bm32", "moe_gemm_down_bf16_bm32",
                   "gated_delta_conv_bf16_dk128", "gated_delta_conv_state_bf16_dk128", "gated_delta_prefill_bf16_dk128",
                   "gated_delta_prefill_norm_bf16", "gated_delta_chunk_prepare_bf16_dk128",
                   "gated_delta_chunk_scan_bf16_dk128", "attention_prefill_mma_bf16_d256"}
# The short-prompt cases add the f32-output 8-bit router and shared-expert gate as qmv and as the 16-row GEMM (the
# kernel choice at 5-8 rows, tuning::qmv_takes).
SHORT_PROMPT_KERNELS = {"qmv_q8_g64_bf16_of32", "qmm_q8_g64_bf16_of32_bm16"}
# The GEMV on matrix units (CUDA's choice for up to 8 rows, tuning::mma_gemv) at every qmv shape and row count, and
# as the lm_head of a prompt's last row (f32 logits).
MMA_GEMV_KERNELS = {"qmv_mma_q4_g64_bf16", "qmv_mma_q4_g64_bf16_of32"}


def test_cases_cover_every_decode_kernel_and_qmv_row_count() -> None:
    cases = bench_kernels.cases()
    assert {c.kernel for c in cases} == DECODE_KERNELS | PREFILL_KERNELS | SHORT_PROMPT_KERNELS | MMA_GEMV_KERNELS
    for kernel, label in (("qmv_q4_g64_bf16", "qmv lm_head"), ("qmv_mma_q4_g64_bf16", "qmv_mma lm_head")):
        lm_head = [c for c in cases if c.kernel == kernel and c.label.startswith(label)]
        assert [c.buffers[0][8] for c in lm_head] == [1, 2, 4, 8], kernel  # QMatmulArgs.num_rows
    assert all(c.bytes_moved > 0 for c in cases)


@pytest.mark.parametrize("tokens,bm", [(512, 16), (512, 32), (4096, 32)])
def test_moe_routing_is_the_block_map_the_kernels_expect(tokens, bm) -> None:
    """Every (token, slot) pair once, expert-contiguous; tiles of at most bm rows of one expert cover them in order."""
    import numpy as np

    pairs, tile_map, tile_count, max_tiles = bench_kernels._routing(tokens, bm)
    pairs = np.frombuffer(pairs, np.uint32)
    tiles = np.frombuffer(tile_map, np.uint32).reshape(max_tiles, 4)[:np.frombuffer(tile_count, np.uint32)[0]]
    assert sorted(pairs) == list(range(tokens * bench_kernels.TOP_K))
    assert tiles[:, 2].max() <= bm and tiles[:, 2].sum() == tokens * bench_kernels.TOP_K
    assert list(tiles[:, 1]) == list(np.cumsum(tiles[:, 2]) - tiles[:, 2])  # consecutive sorted rows
    assert all(np.diff(tiles[:, 0].astype(int)) >= 0)  # experts in order


def test_dry_run_without_ptx_lists_the_cases(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("LILY_CUDA_PTX_DIR", str(tmp_path))
    assert bench_kernels.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{len(bench_kernels.cases())} cases; arguments not checked" in out


def test_dry_run_checks_arguments_against_the_ptx(monkeypatch, tmp_path, capsys) -> None:
    try:
        tc = cuda_kernels.find_toolchain()
    except cuda_kernels.ToolchainError as exc:
        pytest.skip(f"no CUDA toolchain: {exc}")
    for stem in ("rms_norm", "embedding"):
        cuda_kernels.compile_source(ROOT / "metal" / f"{stem}.metal", tmp_path, tc)
    monkeypatch.setenv("LILY_CUDA_PTX_DIR", str(tmp_path))
    assert bench_kernels.main(["--dry-run", "--kernels", "rms_norm|embedding"]) == 0
    assert "2 cases; arguments checked" in capsys.readouterr().out
    # A wrong argument struct or a missing binding is caught before any GPU work.
    tables = bench_kernels.ptx_parameter_tables(tmp_path)
    case = bench_kernels.rms_norm_case()
    case.buffers[0] = case.buffers[0][:8]
    with pytest.raises(ValueError, match=r"rms_norm_bf16 \[\[buffer\(0\)\]\] expects 16 bytes; got 8"):
        bench_kernels.check_case(case, tables[case.kernel])
    case = bench_kernels.embedding_case()
    del case.buffers[-1]
    with pytest.raises(ValueError, match=r"\[\[buffer\(5\)\]\] is not bound"):
        bench_kernels.check_case(case, tables[case.kernel])


def test_attention_split_rule_matches_the_engine() -> None:
    """The script's copy of the split-KV rule uses metal/lily.h's constants and picks the CUDA engine's block counts
    (tuning::attention_split_blocks with short blocks; the engine test test_split_kv_blocks_by_runtime checks the
    engine's side), and the engine's simdgroups per attention_decode_partial_mma threadgroup."""
    header = (ROOT / "metal" / "lily.h").read_text()
    for name in ("ATTN_SPLIT_MIN_KEYS", "ATTN_SPLIT_MAX_BLOCKS", "ATTN_SPLIT_SHORT_BLOCK_KEYS",
                 "ATTN_DECODE_MMA_SIMDGROUPS"):
        assert f"#define LILY_{name} {getattr(bench_kernels, name)}\n" in header
    blocks = {keys: bench_kernels.attention_split_blocks(keys) for keys in (255, 256, 511, 512, 1024, 4096, 8192,
                                                                            16384, 32768)}
    assert blocks == {255: 0, 256: 8, 511: 8, 512: 16, 1024: 32, 4096: 64, 8192: 64, 16384: 64, 32768: 64}


def test_deltanet_scan_cases_at_512_and_4096_tokens() -> None:
    """The chunked scan's two kernels at both lengths, the token scan beside them, all at the model's head shapes."""
    labels = {c.label for c in bench_kernels.cases() if "gated_delta" in c.kernel}
    for tokens in (512, 4096):
        assert {f"gated_delta_chunk_prepare, T={tokens}", f"gated_delta_chunk_scan, T={tokens}",
                f"gated_delta_prefill scan, T={tokens}"} <= labels
    scan = next(c for c in bench_kernels.cases() if c.label == "gated_delta_chunk_scan, T=4096")
    assert scan.grid == (32, 8, 1) and scan.threads == (64, 1, 1) and scan.buffers[0][:4] == (4096).to_bytes(4, "little")


def test_prefill_attention_cases_are_the_engines_launches() -> None:
    """A 512-token chunk first and after 4096 tokens of context, with the grid the engine uses
    (ops/attention_prefill.cpp: 8 queries x the model's 8 heads of one KV head per threadgroup, metal/lily.h's
    constants) and the causal FLOPs."""
    header = (ROOT / "metal" / "lily.h").read_text()
    assert f"#define LILY_ATTN_MMA_QUERIES {bench_kernels.ATTN_MMA_QUERIES}\n" in header
    assert f"#define LILY_ATTN_MMA_HEADS_PER_GROUP {bench_kernels.ATTN_MMA_HEADS_PER_GROUP}\n" in header
    cases = bench_kernels.attention_prefill_cases()
    assert [c.label for c in cases] == ["attention_prefill_mma T=512, 512 keys",
                                        "attention_prefill_mma T=512, 4608 keys"]
    for c, keys in zip(cases, (512, 4608)):
        assert c.grid == (64, 2, 1) and c.threads == (256, 1, 1)
        assert c.buffers[0][12:16] == keys.to_bytes(4, "little")  # AttentionArgs.num_keys
        assert c.flops == 4 * 256 * 16 * sum(keys - 512 + t + 1 for t in range(512))
