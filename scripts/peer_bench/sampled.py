"""Greedy against sampled decode in one process: the peer run's check that choosing tokens by sampling on the GPU
costs a decode little (issue 21's bar: a sampled decode within 5 % of greedy).

    python scripts/peer_bench/sampled.py OUT.json [--rounds 5] [--tokens 128] [--prompt 64] [--backend cuda]

One model, `lily bench --dummy-weights --full-size`'s (random 4-bit weights of the full-size shape); a prompt of
--prompt random ids; then round by round a greedy decode (temperature 0) and a sampled one (temperature 0.7, top-p
0.9, top-k 50, seed 1) of --tokens tokens each, both from the prompt prefilled afresh, repetition penalty 1 and no
stop tokens, so both make the same number of decode steps. One warm-up round first, not counted. Writes each mode's
tok/s per round, their medians and the ratio sampled / greedy to OUT.json, and prints them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lily.bench import GREEDY_DECODE, SAMPLED_DECODE, SAMPLED_DECODE_NAME

# The decode options of each mode (lily.sampling's names): lily bench's greedy and the bar's sampled decode.
MODES = {"greedy": GREEDY_DECODE, "sampled": SAMPLED_DECODE}


def measure(model, prompt: Sequence[int], rounds: int, tokens: int,
            clock: Callable[[], float] = time.perf_counter) -> dict:
    """tok/s of each mode over `rounds` rounds after one warm-up round, the modes interleaved within each round."""
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(rounds + 1):
        for mode, options in MODES.items():
            session = model.prefill(list(prompt), use_cache=False)
            start = clock()
            made = sum(1 for _ in session.decode(max_tokens=tokens, stop_token_ids=(), **options))
            elapsed = clock() - start
            if made != tokens:
                raise RuntimeError(f"sampled.py: the {mode} decode made {made} tokens, not {tokens}")
            if round_:
                rates[mode].append(tokens / elapsed)
    medians = {mode: statistics.median(r) for mode, r in rates.items()}
    return {"tokens": tokens, "rounds": rates, "median": medians, "modes": MODES,
            "sampled_over_greedy": medians["sampled"] / medians["greedy"]}


def summary(result: dict) -> str:
    """One line: the ratio, then the two medians."""
    median = result["median"]
    rounds = len(result["rounds"]["greedy"])
    return (f"sampled ({SAMPLED_DECODE_NAME}) / greedy decode: {result['sampled_over_greedy']:.3f} "
            f"({median['sampled']:.1f} / {median['greedy']:.1f} tok/s, tg{result['tokens']}, medians of {rounds} "
            "rounds in one process)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON to write")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in random token ids")
    parser.add_argument("--backend", default="cuda")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.tokens < 1 or args.prompt < 1:
        parser.error("--rounds, --tokens and --prompt must be at least 1")

    import numpy as np

    from lily import Model

    model = Model.load("full-size", load_format="dummy", backend=args.backend, progress=False)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt).tolist()
    result = measure(model, prompt, args.rounds, args.tokens)
    args.out.write_text(json.dumps(result, indent=1))
    for mode, rates in result["rounds"].items():
        print(f"{mode}: {', '.join(f'{r:.1f}' for r in rates)} tok/s")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
