#!/usr/bin/env python3
"""Decode A/B on one GPU in one process: tg<N> of several variants of the CUDA engine, interleaved round by round.

Each variant is one model loaded with its own PTX folder, environment and engine switches, so kernel sets, switches
(LILY_DISABLE_<NAME>) and tuning options (split_kv_min_keys) compare under the same GPU state, clock and process:

    python scripts/decode_ab.py --depths 0,4096 --rounds 6 \\
        base=PTX,LILY_DISABLE_FUSED_ATTENTION_PREP=1  fused=PTX  blocks16=PTX,sw.split_kv_min_keys=512

A variant is NAME=PTX_DIR[,VAR=VALUE...][,sw.OPTION=VALUE...]: VAR=VALUE is set in the environment only while that model
loads; sw.OPTION=VALUE is an engine switch or test option (lily.backends.engine: SWITCHES, TEST_OPTIONS) passed to that
model only. Decodes are timed as `lily bench` times them (lily.bench._time_generate) after a warm-up that records the
step, greedy, or with --sampled as the peer run's sampled stage (lily.bench.SAMPLED_DECODE: the token chosen by the
GPU's sampler); the table gives each variant's median tok/s and its ratio to the first. With --profile N, each variant's
N-token decode then runs under the CUDA profiler (torch.profiler) and a timeline prints what each kernel adds to the
critical path (its end minus the latest end before it) per token. With --prefill N[,N...] each variant times pp<N>
instead (a prompt of N random ids after the depth's context, as `lily bench` times it), for prefill kernels and
switches (SPLIT_PREFILL_KV). The default model is the full-size shape on dummy weights (`lily bench --dummy-weights
--full-size`); --model takes a checkpoint path instead.

Two models of the same step can differ by about 1 % round after round (an H100, 2026-12-05: docs/performance.md), so
for differences that small load the baseline twice (base=PTX base2=PTX ...) and read its two rows as the floor.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager

import numpy as np

from lily.backends.engine import SWITCHES


def parse_variant(spec: str) -> tuple[str, str, dict[str, str], dict[str, object]]:
    """NAME=PTX_DIR[,VAR=VALUE...][,sw.OPTION=VALUE...] -> (name, folder, environment, switches)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"decode_ab: a variant is NAME=PTX_DIR[,VAR=VALUE...][,sw.OPTION=VALUE...]; got {spec!r}")
    folder, *settings = rest.split(",")
    environment, switches = {}, {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise SystemExit(f"decode_ab: {setting!r} in variant {name!r} is not VAR=VALUE")
        if key.startswith("sw."):
            switches[key[3:]] = value not in ("0", "false", "off") if key[3:] in SWITCHES else int(value)
        else:
            environment[key] = value
    return name, folder, environment, switches


@contextmanager
def loading_with(folder: str, environment: dict[str, str], switches: dict[str, object]):
    """The environment and engine switches one variant loads under; restored afterwards."""
    from lily.backends import engine

    saved, chosen = dict(os.environ), engine.engine_switches
    os.environ["LILY_CUDA_PTX_DIR"] = folder
    os.environ.update(environment)
    engine.engine_switches = lambda given: chosen({**given, **switches})
    try:
        yield
    finally:
        engine.engine_switches = chosen
        os.environ.clear()
        os.environ.update(saved)


def token_boundaries(events: list[dict]) -> tuple[list[float], list[float]]:
    """Between consecutive decode steps (each starts with its embedding_gather kernel): the time from the latest
    kernel end of the step before to that kernel's start, and how much of it copies took (the positional upload), in
    us. `events`: kernels and copies sorted by start, chrome-trace fields (name, ts, dur)."""
    gaps, copies = [], []
    last_end, copied, seen_step = 0.0, 0.0, False
    for e in events:
        if e["name"].startswith("Memcpy"):
            copied += e["dur"]
            continue
        if e["name"].startswith("embedding_gather"):
            if seen_step:
                gaps.append(e["ts"] - last_end)
                copies.append(copied)
            seen_step, copied = True, 0.0
        last_end = max(last_end, e["ts"] + e["dur"])
    return gaps, copies


def timeline(prof, name: str, tokens: int, top: int) -> None:
    """Kernels in start order; per kernel, what it adds to the critical path (its end minus the latest end before
    it) and its mean gap from that end to its start (negative: it overlapped), per token; then the median gap between
    decode steps."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy")]
    events.sort(key=lambda e: e["ts"])
    gaps, copies = token_boundaries(events)
    if gaps:
        print(f"== between steps ({name}): median gap {statistics.median(gaps):.1f} us (min {min(gaps):.1f}, max "
              f"{max(gaps):.1f}) over {len(gaps)} boundaries, copies in it {statistics.median(copies):.1f} us")
    adds, gaps, count = collections.Counter(), collections.Counter(), collections.Counter()
    last_end = events[0]["ts"]
    for e in events:
        end = e["ts"] + e["dur"]
        adds[e["name"]] += max(0.0, end - last_end)
        gaps[e["name"]] += e["ts"] - last_end
        count[e["name"]] += 1
        last_end = max(last_end, end)
    print(f"== timeline {name}: span {(last_end - events[0]['ts']) / tokens:.1f} us/token over {len(events)} events")
    for kernel, added in adds.most_common(top):
        print(f"  adds {added / tokens:8.1f} us/token  mean gap {gaps[kernel] / count[kernel]:6.2f} us  "
              f"n={count[kernel] // tokens:3d}  {kernel[:60]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="NAME=PTX_DIR[,VAR=VALUE...][,sw.OPTION=VALUE...]")
    ap.add_argument("--depths", default="0", help="context depths, comma-separated (default 0)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gen", type=int, default=128, help="tokens per timed decode (default 128)")
    ap.add_argument("--warmup", type=int, default=16, help="tokens of the decode that records the step (default 16)")
    ap.add_argument("--profile", type=int, default=0, help="tokens of a profiled decode per variant (0: none)")
    ap.add_argument("--top", type=int, default=14, help="kernels the profile lists (default 14)")
    ap.add_argument("--model", default="full-size", help="a checkpoint path, or full-size dummy weights (default)")
    ap.add_argument("--sampled", action="store_true",
                    help="decode sampled as the peer run's sampled stage (lily.bench.SAMPLED_DECODE), not greedy")
    ap.add_argument("--prefill", default="", help="prompt lengths, comma-separated: time pp<N> instead of tg")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    if len({v[0] for v in variants}) != len(variants):
        raise SystemExit("decode_ab: variant names must differ")

    if args.profile:  # the profiler's CUDA context first, as torch expects; the engine shares the primary context
        import torch

        torch.zeros(1, device="cuda")
    import lily
    from lily.bench import SAMPLED_DECODE, SAMPLED_DECODE_NAME, _depth_session, _random_ids, _time_generate, _time_prefill

    options = SAMPLED_DECODE if args.sampled else None  # None: lily bench's greedy decode
    prompts = [int(n) for n in args.prefill.split(",")] if args.prefill else []

    def tokens_per_second(model, base, prompt: int | None) -> float:
        """One timed run: pp<prompt> (the same random ids every time), else tg<gen>."""
        if prompt is None:
            return args.gen / _time_generate(model, base, args.gen, 1000, options)
        return prompt / _time_prefill(model, base, _random_ids(model, prompt, np.random.default_rng(prompt)))

    depths = [int(d) for d in args.depths.split(",")]
    models, bases = {}, {}
    for name, folder, environment, switches in variants:
        start = time.time()
        with loading_with(folder, environment, switches):
            models[name] = lily.Model.load(args.model, load_format="dummy" if args.model == "full-size" else "auto",
                                           backend="cuda", precision="bfloat16", progress=False,
                                           max_context=max(depths) + max([args.gen, *prompts]) + 1024)
            dispatches = {}
            for d in depths:
                bases[name, d] = _depth_session(models[name], d, np.random.default_rng(0))
                for prompt in prompts or [None]:  # warm-up: records the step or the prompt's pass
                    tokens_per_second(models[name], bases[name, d], prompt)
                dispatches[d] = models[name].backend.last_step_counts()["dispatches"]
        print(f"loaded {name} ({folder}, {environment}, {switches}) in {time.time() - start:.1f} s: "
              + ", ".join(f"{count} dispatches per {'pass' if prompts else 'token'} at depth {d}"
                          for d, count in dispatches.items()), flush=True)

    names = list(models)
    for d in depths:
        for prompt in prompts or [None]:
            speeds = {n: [] for n in names}
            for r in range(args.rounds):
                for n in names[r % len(names):] + names[:r % len(names)]:  # each round starts with the next variant
                    speeds[n].append(tokens_per_second(models[n], bases[n, d], prompt))
                print(f"d{d} round {r}: " + "  ".join(f"{n} {speeds[n][-1]:.1f}" for n in names), flush=True)
            first = statistics.median(speeds[names[0]])
            mode = f" sampled ({SAMPLED_DECODE_NAME})" if args.sampled else ""
            test = f"pp{prompt}" if prompt else f"tg{args.gen}{mode}"
            print(f"== {test} @ d{d}, median of {args.rounds} (tok/s, ratio to {names[0]})")
            for n in names:
                median = statistics.median(speeds[n])
                print(f"{n:>12} {median:8.1f}  {median / first:6.3f}  min {min(speeds[n]):.1f} max "
                      f"{max(speeds[n]):.1f}", flush=True)

    if args.profile:
        import torch
        from torch.profiler import ProfilerActivity, profile

        for n in names:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _time_generate(models[n], bases[n, depths[0]], args.profile, 1000, options)
                torch.cuda.synchronize()
            timeline(prof, n, args.profile, args.top)


if __name__ == "__main__":
    main()
