"""Lily's CPU backend against HF transformers on CPU torch, in one run on one machine.

The demo model (or any Lily checkpoint) is converted to the HF layout: every weight dequantized to float32 (the
exact values the 4-bit model computes with) and loaded into transformers' ``Qwen3_5MoeForCausalLM``. Both engines
then run pp512 (one 512-token prompt keeping the last row of logits, as ``Model.prefill`` does) and tg128 (128
greedy tokens after a 1-token prompt), each ``--repetitions`` times, on the same number of threads; the medians and
the ratio Lily / HF are printed.

Lily is measured through its user path (``lily bench``'s code: ``Model.prefill`` and ``Session.decode``); HF through
the model's own forward with its cache, greedy, under ``torch.inference_mode``.

    python scripts/bench_cpu.py [--model lily:demo] [--repetitions 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def hf_state_dict(checkpoint) -> dict:
    """The checkpoint's weights under transformers' names, dequantized to float32 torch tensors."""
    import torch

    args, weights = checkpoint.args, checkpoint.weights

    def dense(name: str) -> np.ndarray:
        tensor = weights[name]
        return tensor.dequantize() if hasattr(tensor, "dequantize") else np.asarray(tensor, dtype=np.float32)

    out = {}
    for name in weights:
        if ".switch_mlp." in name:
            continue
        value = dense(name)
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
            value = value - np.float32(1.0)  # canonical norms are 1 + w; transformers adds the 1 itself
        if name.endswith("conv1d.weight"):
            value = value[:, None, :]  # [C, K] -> [C, 1, K]
        out[name if name == "lm_head.weight" else "model." + name] = torch.from_numpy(np.array(value, np.float32))
    for layer in range(args.num_hidden_layers):
        prefix = f"layers.{layer}.mlp."
        gate, up, down = (dense(prefix + f"switch_mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
        out[f"model.{prefix}experts.gate_up_proj"] = torch.from_numpy(np.concatenate([gate, up], axis=1))
        out[f"model.{prefix}experts.down_proj"] = torch.from_numpy(np.array(down, np.float32))
    return out


def build_hf_model(directory: Path, checkpoint):
    """transformers' Qwen3_5MoeForCausalLM (float32, eval) holding the checkpoint's dequantized weights."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = json.loads((directory / "config.json").read_text())
    text = {k: v for k, v in config.get("text_config", config).items() if k != "quantization"}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text)).float().eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(checkpoint), strict=False)
    if missing or unexpected:
        raise SystemExit(f"conversion to the HF layout failed: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def hf_prefill_seconds(model, ids: list[int]) -> float:
    """Seconds for one prefill of ``ids`` that keeps the last row of logits, as Lily's prefill does."""
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


def hf_generate(model, first: int, count: int) -> tuple[float, list[int]]:
    """Seconds for ``count`` greedy tokens after a 1-token prompt (the prompt's forward not counted), and them."""
    import torch

    with torch.inference_mode():
        out = model(torch.tensor([[first]]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        start = time.perf_counter()
        for _ in range(count - 1):
            out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return time.perf_counter() - start, tokens


def check_same_model(lily_model, hf_model, ids: list[int]) -> float:
    """Relative logits difference of the two engines on one prompt: the conversion must be exact."""
    import torch

    ours = lily_model.logits(ids)
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].numpy()
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lily:demo")
    parser.add_argument("--repetitions", "-r", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="threads for both (default: the usable CPUs)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    opts = parser.parse_args(argv)
    if opts.repetitions < 5:
        parser.error("--repetitions must be >= 5 (medians of at least 5 runs)")

    from lily.backends.cpu import default_threads

    threads = opts.threads or default_threads()
    os.environ["LILY_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)

    from lily import Model, hub
    from lily.bench import run_bench
    from lily.checkpoint import load_checkpoint

    directory = Path(hub.resolve(opts.model))
    lily_model = Model.load(directory, backend="cpu")
    hf_model = build_hf_model(directory, load_checkpoint(directory))
    rng = np.random.default_rng(0)
    vocab = min(lily_model.config.vocab_size, lily_model.tokenizer.vocab_size if lily_model.tokenizer else 1 << 30)
    probe = rng.integers(0, vocab, 64).tolist()
    difference = check_same_model(lily_model, hf_model, probe)
    print(f"same model: Lily cpu vs HF logits max relative difference {difference:.2e} (64 tokens)")

    rows = {row.test: row for row in run_bench(lily_model, prompts=(opts.prompt,), gens=(opts.gen,),
                                               repetitions=opts.repetitions, seed=0)}
    lily = {"pp": statistics.median(rows[f"pp{opts.prompt}"].samples_ts),
            "tg": statistics.median(rows[f"tg{opts.gen}"].samples_ts)}

    hf_prefill_seconds(hf_model, rng.integers(0, vocab, 8).tolist())  # warm-up
    pp = [opts.prompt / hf_prefill_seconds(hf_model, rng.integers(0, vocab, opts.prompt).tolist())
          for _ in range(opts.repetitions)]
    tg = [opts.gen / hf_generate(hf_model, int(rng.integers(0, vocab)), opts.gen + 1)[0]
          for _ in range(opts.repetitions)]
    hf = {"pp": statistics.median(pp), "tg": statistics.median(tg)}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {platform.machine()} "
          f"{platform.system()}, {os.cpu_count()} CPUs, {threads} threads, torch {torch.__version__}, "
          f"medians of {opts.repetitions} runs, model {opts.model}\n")
    print("| test | Lily cpu (t/s) | HF transformers fp32 (t/s) | Lily / HF |")
    print("| --- | ---: | ---: | ---: |")
    for key, label in (("pp", f"pp{opts.prompt}"), ("tg", f"tg{opts.gen}")):
        print(f"| {label} | {lily[key]:.1f} | {hf[key]:.1f} | {lily[key] / hf[key]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
