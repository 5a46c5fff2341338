"""Write a random Q4_0 GGUF of a Qwen3.5/3.6 MoE configuration for llama.cpp's ``llama-bench`` (architecture
``qwen35moe``): the peer side of ``scripts/peer_bench/run.sh``.

Tensor names and shapes follow llama.cpp's qwen35moe loader (src/models/qwen35moe.cpp at the bundled commit): fused
``attn_qkv`` and ``attn_gate`` in the Gated DeltaNet layers, separate q/k/v in the attention layers, stacked
``ffn_{gate,up,down}_exps``, a shared expert with its ``ffn_gate_inp_shexp`` vector. As llama.cpp's ``--pure`` Q4_0
quantization leaves them: norms, the router (``ffn_gate_inp``), ``ssm_conv1d``, ``ssm_a`` and ``ssm_dt`` in F32,
every other matrix Q4_0. Metadata: the keys of llama.cpp's own tiny fixture (tests/test-llama-archs.cpp) that this
architecture reads, with the configuration's values, and no vocabulary (``no_vocab`` with ``vocab_size``).

Q4_0 blocks are zero-mean: nibbles uniform in 1..15 (value (q - 8) * d, a zero nibble drawn as 8) and signed scales
whose magnitude keeps each matrix's output RMS at its input's. All-positive random bytes would add one common vector
to every token's hidden state, which takes it over, and every token would route to the same experts
(docs/performance.md, the peer benchmark).

    python scripts/peer_bench/write_gguf.py OUT.gguf [--config config.json] [--gguf-py DIR]

Without ``--config``: Qwen3.6-35B-A3B (``lily.config.FULL_SIZE_CONFIG``; about 19.6 GB). ``--gguf-py``: the gguf-py
to import (the bundled one of the llama.cpp tree), else the installed ``gguf`` package.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ARCH = "qwen35moe"
Q4_0_BLOCK = 32  # values per block: an fp16 scale and 16 bytes of nibbles
_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
# A byte whose nibbles are both in 1..15: a zero nibble becomes 8 (the value 0), so the codes stay symmetric.
_NONZERO_NIBBLES = np.array([((b & 15) or 8) | (((b >> 4) or 8) << 4) for b in range(256)], np.uint8)
_Q_STD = math.sqrt(sum(k * k for k in range(-7, 8)) / 16)  # of q - 8, 0 drawn twice in 16: sqrt(17.5)
_ROWS_PER_CHUNK = 4096


def tensor_plan(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape [.., rows, row length], "Q4_0" or "F32") of every tensor, in file order. GGUF lists
    dimensions innermost first: numpy (E, H, I) is llama.cpp's {I, H, E}."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv_dim, value_dim = 2 * hk * dk + hv * dv, hv * dv
    experts, inter = config["num_experts"], config["moe_intermediate_size"]
    shared = config["shared_expert_intermediate_size"]
    plan = [("token_embd.weight", (v, h), "Q4_0"), ("output_norm.weight", (h,), "F32"),
            ("output.weight", (v, h), "Q4_0")]
    for i, kind in enumerate(config["layer_types"]):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (h,), "F32"), (p + "post_attention_norm.weight", (h,), "F32")]
        if kind == "full_attention":
            plan += [(p + "attn_q.weight", (2 * heads * head_dim, h), "Q4_0"),
                     (p + "attn_k.weight", (kv_heads * head_dim, h), "Q4_0"),
                     (p + "attn_v.weight", (kv_heads * head_dim, h), "Q4_0"),
                     (p + "attn_output.weight", (h, heads * head_dim), "Q4_0"),
                     (p + "attn_q_norm.weight", (head_dim,), "F32"), (p + "attn_k_norm.weight", (head_dim,), "F32")]
        else:
            plan += [(p + "attn_qkv.weight", (conv_dim, h), "Q4_0"), (p + "attn_gate.weight", (value_dim, h), "Q4_0"),
                     (p + "ssm_conv1d.weight", (conv_dim, config["linear_conv_kernel_dim"]), "F32"),
                     (p + "ssm_dt.bias", (hv,), "F32"), (p + "ssm_a", (hv,), "F32"),
                     (p + "ssm_beta.weight", (hv, h), "Q4_0"), (p + "ssm_alpha.weight", (hv, h), "Q4_0"),
                     (p + "ssm_norm.weight", (dv,), "F32"), (p + "ssm_out.weight", (h, value_dim), "Q4_0")]
        plan += [(p + "ffn_gate_inp.weight", (experts, h), "F32"),
                 (p + "ffn_gate_exps.weight", (experts, inter, h), "Q4_0"),
                 (p + "ffn_up_exps.weight", (experts, inter, h), "Q4_0"),
                 (p + "ffn_down_exps.weight", (experts, h, inter), "Q4_0"),
                 (p + "ffn_gate_inp_shexp.weight", (h,), "F32"),
                 (p + "ffn_gate_shexp.weight", (shared, h), "Q4_0"), (p + "ffn_up_shexp.weight", (shared, h), "Q4_0"),
                 (p + "ffn_down_shexp.weight", (h, shared), "Q4_0")]
    return plan


def q4_0_bytes(shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
    """Random zero-mean Q4_0 blocks of a tensor of ``shape`` whose values have standard deviation about ``std``,
    as uint8 [.., rows, row length / 32 * 18] (gguf-py's byte shape for a quantized tensor)."""
    *lead, row = shape
    rows = math.prod(lead)
    blocks = np.empty((rows, row // Q4_0_BLOCK), _BLOCK)

    def fill(start: int) -> None:
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed, spawn_key=(start,))))
        part = blocks[start:start + _ROWS_PER_CHUNK]
        scale = rng.uniform(0.75, 1.25, size=part.shape) * (std / _Q_STD)
        part["d"] = np.where(rng.integers(0, 2, size=part.shape, dtype=np.uint8) == 1, scale, -scale)
        part["qs"] = _NONZERO_NIBBLES[rng.integers(0, 256, size=part.shape + (16,), dtype=np.uint8)]

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(fill, range(0, rows, _ROWS_PER_CHUNK)))
    return blocks.view(np.uint8).reshape(*lead, row // Q4_0_BLOCK * _BLOCK.itemsize)


def f32_values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Norms 1; ssm_a = -exp(A_log) with A uniform in [1, 16] (HF's initialisation); ssm_dt 1; conv taps and router
    normal, keeping their input's RMS."""
    rng = np.random.default_rng(seed)
    if name.endswith("norm.weight") or name.endswith("ssm_dt.bias"):
        return np.ones(shape, np.float32)
    if name.endswith("ssm_a"):
        return -rng.uniform(1.0, 16.0, size=shape).astype(np.float32)
    return rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), size=shape).astype(np.float32)


def write(path: Path, config: dict, gguf: object, *, seed: int = 0) -> int:
    """Write the GGUF; returns its size in bytes. Tensors are generated and written one at a time."""
    writer = gguf.GGUFWriter(str(path), ARCH)
    rope_dim = int(config["head_dim"] * config.get("rope_parameters", {}).get("partial_rotary_factor", 0.25))
    writer.add_name("lily peer benchmark (random Q4_0, zero-mean)")
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(len(config["layer_types"]))
    writer.add_feed_forward_length(config["moe_intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(rope_dim)
    writer.add_rope_freq_base(float(config.get("rope_parameters", {}).get("rope_theta", 1e7)))
    sections = list(config.get("rope_parameters", {}).get("mrope_section", [11, 11, 10]))  # Qwen3.5's
    writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_inner_size(config["linear_num_value_heads"] * config["linear_value_head_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    interval = next(i + 1 for i, kind in enumerate(config["layer_types"]) if kind == "full_attention")
    writer.add_full_attention_interval(interval)
    writer.add_tokenizer_model("no_vocab")

    plan = tensor_plan(config)
    for name, shape, kind in plan:
        if kind == "Q4_0":
            nbytes = math.prod(shape) // Q4_0_BLOCK * _BLOCK.itemsize
            byte_shape = (*shape[:-1], shape[-1] // Q4_0_BLOCK * _BLOCK.itemsize)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), math.prod(shape) * 4)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, shape, kind) in enumerate(plan):
        tensor_seed = seed * 100_003 + index
        if kind == "Q4_0":
            std = 1.0 if name == "token_embd.weight" else 1.0 / math.sqrt(shape[-1])
            writer.write_tensor_data(q4_0_bytes(shape, std, tensor_seed))
        else:
            writer.write_tensor_data(f32_values(name, shape, tensor_seed))
    writer.close()
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--config", type=Path, default=None, help="a qwen3_5_moe_text config.json (default: full size)")
    parser.add_argument("--gguf-py", type=Path, default=None, help="gguf-py directory to import (the bundled one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.gguf_py is not None:
        sys.path.insert(0, str(args.gguf_py))
    try:
        import yaml  # noqa: F401
    except ImportError:  # gguf-py imports PyYAML for model cards only (gguf/metadata.py); the GPU machine may lack it
        sys.modules["yaml"] = types.ModuleType("yaml")
    import gguf

    if args.config is not None:
        config = json.loads(args.config.read_text())
    else:
        from lily.config import FULL_SIZE_CONFIG as config
    start = time.perf_counter()
    size = write(args.out, config, gguf, seed=args.seed)
    print(f"wrote {args.out}: {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s (gguf-py {gguf.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
