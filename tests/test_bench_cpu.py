"""scripts/bench_cpu.py compares like with like: its HF conversion of the demo model computes Lily's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import lily
from lily import hub
from lily.checkpoint import load_checkpoint

from fixtures import load_script, relative_error


def test_the_hf_conversion_of_the_demo_model_matches_the_reference():
    bench = load_script("scripts/bench_cpu.py")
    directory = Path(hub.resolve("lily:demo"))
    hf_model = bench.build_hf_model(directory, load_checkpoint(directory))
    ids = np.random.default_rng(8).integers(0, 2000, 24).tolist()
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].numpy()
    ours = lily.Model.load(directory, backend="reference").logits(ids)
    assert relative_error(theirs, ours) < 1e-4
    # the greedy decode loop the benchmark times produces the reference's greedy tokens
    _, tokens = bench.hf_generate(hf_model, ids[0], 6)
    reference = lily.Model.load(directory, backend="reference")
    assert tokens == reference.generate([ids[0]], max_tokens=6, temperature=0, stop_token_ids=[]).token_ids
    # the timed prefill keeps one row of logits, as Lily's prefill does (transformers' logits_to_keep)
    assert bench.hf_prefill_seconds(hf_model, ids) > 0
