"""The COALESCED_KV ablation: `coalesced_kv` off runs the `attention_decode[_partial]_plain_*` kernels (each lane reads
its own run of consecutive chunks of a K/V row instead of consecutive lanes reading consecutive chunks). Only the
read pattern changes, so the logits match lily.reference and the coalesced engine within fp32 rounding (float32
mode, the Linux test runtime running the real kernels on the CPU harness): at the model's head dim 256 (where the two
mappings differ) on the single-pass and split-KV paths, and on the demo model (head dim 64, where a row is one chunk
per lane and the mappings coincide, but the plain kernels must still be the ones dispatched).
"""

from __future__ import annotations

import numpy as np
import pytest

from lily.checkpoint import load_checkpoint
from lily.backends.engine import switches_from_env
from lily.backends.metal import MetalBackend

from tests.engine.test_metal_head_dims import D256_CONFIG, DEMO, reference_logits, run_backend
from tests.fixtures import build_hf_model, save_hf_checkpoint, save_mlx_checkpoint

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablation_kv")
    hf = save_hf_checkpoint(build_hf_model(D256_CONFIG, seed=11), root / "d256", dtype="bfloat16")
    return {"demo": load_checkpoint(DEMO), "d256": load_checkpoint(save_mlx_checkpoint(hf, root / "d256-mlx"))}


CASES = [
    # (checkpoint, extra switches, head dim suffix)
    ("demo", {}, "d64"),
    ("d256", {}, "d256"),
    ("d256", {"split_kv_min_keys": 1}, "d256"),  # the split-KV partial pass with the plain mapping
]


@pytest.mark.parametrize("name,extra,attn", CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items()) or 'single'}" for c in CASES])
def test_plain_reads_give_the_same_logits(checkpoints, name, extra, attn):
    checkpoint = checkpoints[name]
    coalesced, on_kernels = run_backend(MetalBackend(checkpoint, precision="float32", switches=extra))
    plain, off_kernels = run_backend(MetalBackend(checkpoint, precision="float32",
                                                  switches={**extra, "coalesced_kv": False}))
    want = reference_logits(checkpoint)
    rel = float(np.max(np.abs(plain - want)) / np.max(np.abs(want)))
    assert rel < 1e-4, f"{name} {extra}: relative error {rel:.3g} against the reference"
    np.testing.assert_allclose(plain, coalesced, rtol=0, atol=1e-5 * np.max(np.abs(coalesced)))
    # The switch swaps exactly the decode attention kernel: plain instead of coalesced, same count.
    split = "partial_" if "split_kv_min_keys" in extra else ""
    layers = checkpoint.args.layer_types.count("full_attention")
    assert off_kernels.get(f"attention_decode_{split}plain_f32_{attn}") == layers, sorted(off_kernels)
    assert f"attention_decode_{split}f32_{attn}" not in off_kernels, sorted(off_kernels)
    assert on_kernels.get(f"attention_decode_{split}f32_{attn}") == layers, sorted(on_kernels)
    assert not [k for k in on_kernels if "plain" in k], sorted(on_kernels)


def test_gqa_packing_off_takes_precedence(checkpoints):
    """Both ablations off: the unpacked (coalesced) kernels run; there is no plain unpacked instance."""
    _, kernels = run_backend(MetalBackend(checkpoints["demo"], precision="float32",
                                          switches={"coalesced_kv": False, "gqa_packing": False}))
    layers = checkpoints["demo"].args.layer_types.count("full_attention")
    assert kernels.get("attention_decode_unpacked_f32_d64") == layers, sorted(kernels)
    assert not [k for k in kernels if "plain" in k], sorted(kernels)


def test_coalesced_kv_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_COALESCED_KV": "1"}) == {"coalesced_kv": False}
    assert switches_from_env({"LILY_DISABLE_COALESCED_KV": "0"}) == {}
