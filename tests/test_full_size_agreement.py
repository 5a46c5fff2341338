"""scripts/full_size_agreement.py compares like with like: HF's model filled with Lily's dummy weights computes the
reference backend's logits (fp32, a tiny config), and its comparison counts what it says."""

from __future__ import annotations

import json

import numpy as np

from fixtures import load_script, relative_error, text_config


def test_hf_with_lilys_dummy_weights_computes_the_reference_logits(tmp_path):
    agreement = load_script("scripts/full_size_agreement.py")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**text_config("gqa4"), "model_type": "qwen3_5_moe_text"}))
    ids = np.random.default_rng(3).integers(0, 1024, 20)
    theirs = agreement.hf_logits(str(config), ids, "cpu", "float32")
    ours = agreement.lily_logits(str(config), ids, "reference", None)
    assert relative_error(theirs, ours) < 1e-4
    pair = agreement.compare(theirs, ours)
    assert pair["top1_agreement"] == 1.0 and pair["cosine_min"] > 0.99999 and pair["positions"] == 20


def test_compare_counts_disagreements_and_cosines():
    agreement = load_script("scripts/full_size_agreement.py")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 50)).astype(np.float32)
    b = a.copy()
    b[1] = -a[1]  # cosine -1: the argmax moves
    pair = agreement.compare(a, b)
    assert pair["top1_equal"] == [True, False, True, True] and pair["top1_agreement"] == 0.75
    assert np.isclose(pair["cosine_min"], -1.0) and np.isclose(pair["cosine_median"], 1.0)
