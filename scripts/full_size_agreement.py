"""How far bf16 moves the logits, Lily's and an independent implementation's, at full size (issue 23).

HF transformers' Qwen3.5-MoE runs with Lily's dummy weights (``load_format="dummy"``, the same seed) dequantized to
its dtype; Lily runs the same weights in fp32 and in bf16; all three score the same random prompt, and each pair is
compared position by position: next-token (top-1) agreement and the cosine of the logit rows. If Lily's bf16 stays as
close to Lily's fp32 as HF's bf16 does, Lily's bf16 path loses no more than bf16 itself costs on these weights.

    python scripts/full_size_agreement.py --out agreement.json                       # H200: full size, cuda
    python scripts/full_size_agreement.py --source tiny.json --backend reference \\
        --hf-device cpu --hf-dtype float32 --out /tmp/a.json                        # here: checks the weight mapping

``--source`` is what ``Model.load`` takes with ``load_format="dummy"`` (``full-size`` by default, or a config.json).
Needs torch and transformers with ``Qwen3_5MoeForCausalLM`` (transformers >= 5).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np

from lily import Model
from lily.checkpoint import _SHIFTED_NORM
from lily.config import FULL_SIZE_CONFIG
from lily.dummy import FULL_SIZE, dummy_checkpoint
from lily.quant import QuantizedTensor

def hf_config(source: str) -> dict:
    """The HF text config of ``source``: the built-in full-size one, or a config.json (its text_config if nested)."""
    if source == FULL_SIZE:
        return dict(FULL_SIZE_CONFIG)
    config = json.loads(Path(source).read_text())
    return dict(config.get("text_config", config))


def writable(array, dtype=None):
    """``array`` as torch.from_numpy wants it: C-contiguous and writable (a read-only, e.g. mapped, array is copied,
    one tensor at a time, before its upload)."""
    return np.require(array, dtype=dtype, requirements=["C", "W"])


def dequantized(tensor, torch, device: str, dtype):
    """A Lily weight (QuantizedTensor or float array) as a torch tensor on ``device``: scale * code + bias per group,
    computed in fp32 on the device, rounded once to ``dtype``. lily.quant.dequantize's rule in torch, so that the
    full size's 35 billion weights dequantize on the GPU in seconds rather than in numpy for minutes
    (tests/test_full_size_agreement.py holds the two to the same logits)."""
    if not isinstance(tensor, QuantizedTensor):
        return torch.from_numpy(writable(tensor, np.float32)).to(device).to(dtype)
    words = torch.from_numpy(writable(tensor.weight).view(np.int32)).to(device)
    per_word = 32 // tensor.bits
    shifts = torch.arange(per_word, device=device, dtype=torch.int32) * tensor.bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << tensor.bits) - 1)  # little-endian codes within a word
    codes = codes.reshape(*tensor.weight.shape[:-1], -1, tensor.group_size).float()
    scales = torch.from_numpy(writable(tensor.scales, np.float32)).to(device).unsqueeze(-1)
    biases = torch.from_numpy(writable(tensor.biases, np.float32)).to(device).unsqueeze(-1)
    return (codes * scales + biases).reshape(tensor.shape).to(dtype)


def hf_logits(source: str, ids: np.ndarray, device: str, dtype_name: str) -> np.ndarray:
    """Logits [T, V] (fp32) of HF's Qwen3_5MoeForCausalLM in ``dtype_name`` with Lily's dummy weights of ``source``."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    checkpoint = dummy_checkpoint(source)
    weights = checkpoint.weights
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**hf_config(source))).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    filled = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            canonical = name.removeprefix("model.")
            if canonical.endswith("mlp.experts.gate_up_proj"):
                prefix = canonical.removesuffix("experts.gate_up_proj") + "switch_mlp."
                value = torch.cat([dequantized(weights[prefix + f"{w}_proj.weight"], torch, device, dtype)
                                   for w in ("gate", "up")], dim=1)
                filled.update(prefix + f"{w}_proj.weight" for w in ("gate", "up"))
            elif canonical.endswith("mlp.experts.down_proj"):
                key = canonical.removesuffix("experts.down_proj") + "switch_mlp.down_proj.weight"
                value = dequantized(weights[key], torch, device, dtype)
                filled.add(key)
            else:
                value = dequantized(weights[canonical], torch, device, dtype)
                if _SHIFTED_NORM.match(canonical):  # Lily stores these norms as 1 + w, HF as w
                    value = value - 1
                filled.add(canonical)
            if value.numel() != param.numel():
                raise ValueError(f"{name}: HF holds {tuple(param.shape)}, Lily's {canonical} has {tuple(value.shape)}")
            param.copy_(value.reshape(param.shape))
            del value
        missing = set(weights) - filled
        if missing:
            raise ValueError(f"Lily tensors with no HF parameter: {sorted(missing)[:5]}")
        out = model(torch.as_tensor(ids, device=device).unsqueeze(0)).logits[0].float().cpu().numpy()
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def lily_logits(source: str, ids: np.ndarray, backend: str, precision: str | None) -> np.ndarray:
    model = Model.load(source, backend=backend, precision=precision, load_format="dummy", progress=False)
    out = model.logits([int(i) for i in ids])
    del model
    gc.collect()
    return out


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Top-1 agreement and per-position logit cosine of two [T, V] logit arrays."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cos = np.sum(a64 * b64, axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    agree = a.argmax(axis=1) == b.argmax(axis=1)
    return {"top1_agreement": float(agree.mean()), "positions": int(len(agree)),
            "cosine_min": float(cos.min()), "cosine_median": float(np.median(cos)), "cosine_mean": float(cos.mean()),
            "cosine": [round(float(c), 6) for c in cos], "top1_equal": [bool(x) for x in agree]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=FULL_SIZE, help="full-size (default) or a config.json")
    parser.add_argument("--backend", default="cuda", help="Lily's backend (default cuda)")
    parser.add_argument("--hf-device", default="cuda", help="torch device of the HF model (default cuda)")
    parser.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--positions", type=int, default=48, help="prompt length (default 48)")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompt")
    parser.add_argument("--out", required=True, help="the JSON written")
    args = parser.parse_args()

    vocab = hf_config(args.source)["vocab_size"]
    ids = np.random.default_rng(args.seed).integers(0, vocab, args.positions)
    logits, seconds = {}, {}
    runs = [("lily_float32", lambda: lily_logits(args.source, ids, args.backend, "float32")),
            ("lily_bfloat16", lambda: lily_logits(args.source, ids, args.backend,
                                                  None if args.backend in ("reference", "cpu") else "bfloat16")),
            (f"hf_{args.hf_dtype}", lambda: hf_logits(args.source, ids, args.hf_device, args.hf_dtype))]
    for name, run in runs:
        start = time.perf_counter()
        logits[name] = run()
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
    hf = f"hf_{args.hf_dtype}"
    pairs = {f"{hf} vs lily_float32": compare(logits[hf], logits["lily_float32"]),
             "lily_bfloat16 vs lily_float32": compare(logits["lily_bfloat16"], logits["lily_float32"]),
             f"{hf} vs lily_bfloat16": compare(logits[hf], logits["lily_bfloat16"])}
    result = {"source": args.source, "positions": args.positions, "seed": args.seed, "lily_backend": args.backend,
              "hf": {"device": args.hf_device, "dtype": args.hf_dtype}, "seconds": seconds, "pairs": pairs}
    try:
        import transformers
        result["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, pair in pairs.items():
        print(f"{name}: top-1 {pair['top1_agreement']:.3f}, cosine min {pair['cosine_min']:.5f} "
              f"median {pair['cosine_median']:.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
