"""Short prompts against decode steps on one backend: is a prefill of T tokens about as cheap as one decode step?

Issue 22's bar for the CPU backend: a prefill of 1 token costs at most 1.2 decode steps and one of 8 tokens at most
2. Each round runs, through ``lily bench``'s code (``lily.bench.run_bench``: a fresh session, ``use_cache=False``,
random token ids), prefills of 1, 2, 4 and 8 tokens and two kinds of decode step: ``tg1``, one step after a
1-token prompt (the greedy choice from the prompt's logits and one forward of that token, as a chat's first reply
token), and ``tg32 / 32``, a step inside a run of 32 greedy tokens (steady decoding, the workers awake). The
rounds interleave the tests so that a slow spell of the machine hits all of them. The best and the median of the
rounds are printed, with each prefill's ratio to each decode step (best to best, median to median) beside its bar.

    python scripts/bench_short_prompts.py [--model lily:demo] [--backend cpu] [--rounds 50] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = (1, 2, 4, 8)
STEADY = 32  # tokens of the steady-decoding test
BARS = {1: 1.2, 8: 2.0}  # issue 22: prefill(T) / decode step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lily:demo")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--rounds", "-r", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="LILY_NUM_THREADS (default: the usable CPUs)")
    opts = parser.parse_args(argv)
    if opts.rounds < 5:
        parser.error("--rounds must be >= 5")
    if opts.threads is not None:
        os.environ["LILY_NUM_THREADS"] = str(opts.threads)

    from lily import Model
    from lily.bench import run_bench

    model = Model.load(opts.model, backend=opts.backend)
    samples: dict[str, list[float]] = {}
    for round_ in range(opts.rounds):
        for row in run_bench(model, prompts=PROMPTS, gens=(1, STEADY), repetitions=1, seed=round_, warmup=False):
            samples.setdefault(row.test, []).extend(ns / 1e6 / (row.n_gen or 1) for ns in row.samples_ns)
    best = {test: min(values) for test, values in samples.items()}
    median = {test: statistics.median(values) for test, values in samples.items()}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    threads = getattr(model.backend, "threads", "-")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {platform.machine()} "
          f"{platform.system()}, {os.cpu_count()} CPUs, backend {model.backend_name}, {threads} threads, "
          f"model {opts.model}, best and median of {opts.rounds} rounds\n")
    steady = f"tg{STEADY}"
    print(f"| test | best (ms) | median (ms) | best / tg1 | median / tg1 | best / {steady} step | "
          f"median / {steady} step | bar |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for test, label in [("tg1", "decode step (tg1)"), (steady, f"decode step ({steady} / {STEADY})")] + [
            (f"pp{t}", f"pp{t}") for t in PROMPTS]:
        t = int(test[2:]) if test.startswith("pp") else 0
        bar = f"<= {BARS[t]}" if t in BARS else ""
        print(f"| {label} | {best[test]:.3f} | {median[test]:.3f} | {best[test] / best['tg1']:.2f} | "
              f"{median[test] / median['tg1']:.2f} | {best[test] / best[steady]:.2f} | "
              f"{median[test] / median[steady]:.2f} | {bar} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
