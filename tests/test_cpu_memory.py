"""Peak memory of the cpu backend on a checkpoint with the full-size layer shapes (hidden 2048, 256 experts of
width 512, attention heads 16/2 of dim 256, DeltaNet 16/32 heads of dim 128) but two layers, one of each kind.

The checkpoint is written as MLX 4-bit (routers 8-bit) with random codes, streamed to disk; a subprocess loads it
with backend="cpu", prefills and decodes, and reads its peak resident set (VmHWM). The engine reads the weights
where the file is mapped (the CPU runtime binds tensors at any alignment, unshifted), so the peak stays under 1.2 x
the checkpoint's bytes plus the KV cache and DeltaNet state the engine holds;
an fp32 copy of one layer's experts alone (3.2 GB) would exceed it several times over.

The vocabulary is cut to 32768 rows (from 248320): it only sets the row count of the embedding and lm_head, two
matrices the engine reads in place like every other one, and keeps the file near 1 GB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import canonical_shapes
from lily.config import ModelArgs
from lily.plan import FULL_SIZE_CONFIG

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc (Linux only)")

VOCAB = 32768
GROUP = 64
_BF16_ONE, _BF16_SCALE, _BF16_BIAS = 0x3F80, 0x3B00, 0xBC80  # 1.0, 2^-9, -2^-6: codes 0..15 map to +-0.016


def full_shape_text_config() -> dict:
    text = json.loads(json.dumps(FULL_SIZE_CONFIG))
    text.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=VOCAB)
    return text


def _stored(name: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(file name, dtype, shape) of the stored tensors of one canonical tensor, as mlx_lm.convert writes them."""
    stem = name[: -len(".weight")]
    file_name = "language_model.lm_head" if name == "lm_head.weight" else "language_model.model." + stem
    if name.endswith("conv1d.weight"):
        return [(file_name + ".weight", "BF16", shape + (1,))]
    if len(shape) >= 2:
        bits = 8 if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else 4
        groups = shape[:-1] + (shape[-1] // GROUP,)
        return [(file_name + ".weight", "U32", shape[:-1] + (shape[-1] * bits // 32,)),
                (file_name + ".scales", "BF16", groups), (file_name + ".biases", "BF16", groups)]
    full = "language_model.model." + name
    return [(full, "F32" if name.endswith("A_log") else "BF16", shape)]


def write_checkpoint(directory: Path) -> int:
    """Write the checkpoint (config.json, model.safetensors); returns the weight file's bytes."""
    text = full_shape_text_config()
    args = ModelArgs.from_dict(text, source="full-shape test config")
    quantization = {"group_size": GROUP, "bits": 4, "mode": "affine"}
    for i in range(len(text["layer_types"])):
        for module in ("mlp.gate", "mlp.shared_expert_gate"):
            quantization[f"language_model.model.layers.{i}.{module}"] = {"group_size": GROUP, "bits": 8}
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text, "quantization": quantization, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))

    entries, offset = [], 0
    for name, shape in canonical_shapes(args).items():
        for stored, dtype, stored_shape in _stored(name, tuple(shape)):
            nbytes = int(np.prod(stored_shape)) * (4 if dtype in ("U32", "F32") else 2)
            entries.append((stored, dtype, stored_shape, offset, nbytes))
            offset += nbytes
    header = {s: {"dtype": d, "shape": list(shape), "data_offsets": [o, o + n]} for s, d, shape, o, n in entries}
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    rng = np.random.default_rng(0)
    path = directory / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little") + header_bytes)
        for stored, dtype, _, _, nbytes in entries:
            if dtype == "U32":  # random codes, written in 64 MiB pieces
                for start in range(0, nbytes, 1 << 26):
                    f.write(rng.bytes(min(1 << 26, nbytes - start)))
            elif dtype == "F32":
                f.write(np.zeros(nbytes // 4, np.float32).tobytes())
            else:
                value = _BF16_SCALE if stored.endswith(".scales") else _BF16_BIAS if stored.endswith(".biases") \
                    else _BF16_ONE if stored.endswith("norm.weight") else 0
                f.write(np.full(nbytes // 2, value, np.uint16).tobytes())
    return path.stat().st_size


_MEASURE = """
import json, sys
import numpy as np
import lily
model = lily.Model.load(sys.argv[1], backend="cpu")
session = model.prefill(list(range(1, 65)), use_cache=False)
tokens = [t.id for t in session.decode(max_tokens=16, temperature=0, stop_token_ids=[])]
held = model.backend._engine.device_memory()  # the engine's buffers: the KV cache and the DeltaNet and conv states
state = held["kv_cache"] + held["state"]
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"hwm": hwm, "state": state, "tokens": tokens, "backend": model.backend_name}))
"""


def test_peak_memory_stays_near_the_checkpoint_size(tmp_path):
    checkpoint_bytes = write_checkpoint(tmp_path)
    assert 0.9e9 < checkpoint_bytes < 1.1e9
    run = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env={**__import__("os").environ, "LILY_NUM_THREADS": "2"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["backend"] == "cpu" and len(result["tokens"]) == 16
    budget = 1.2 * checkpoint_bytes + result["state"]
    assert result["hwm"] < budget, (
        f"peak RSS {result['hwm'] / 1e6:.0f} MB over the budget {budget / 1e6:.0f} MB "
        f"(checkpoint {checkpoint_bytes / 1e6:.0f} MB, state {result['state'] / 1e6:.1f} MB)"
    )
