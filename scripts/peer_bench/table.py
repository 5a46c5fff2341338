"""The peer benchmark's table: Lily and llama.cpp side by side from the files ``run.sh`` leaves in its output folder.

    python scripts/peer_bench/table.py OUT_DIR

Reads ``llama-bench.json`` (``llama-bench -o json``), ``lily-bench.json`` (``lily bench -o json``), ``plan.json``
(bytes per decode token at each depth, from ``lily plan``: every weight byte once, the recurrent and conv states read
and written, the KV cache read) and ``bandwidth.json`` (device-to-device copy bandwidth, read + write, measured in the
same run). For each test: the median tok/s over the repetitions, and for decode the GB/s that rate implies (tok/s x
bytes per token) and its fraction of the copy bandwidth; prefill is compute-bound (performance.md §3.2), so its rows
have no bandwidth figures. The last column is Lily / llama.cpp. A test one side did not run shows "-". Where the run
has ``sampled.json`` (``sampled.py``: Lily's greedy against sampled decode), its line follows the table. A line under
the table says when each side ran (the rows' ``test_time``); sides measured more than ``MAX_APART`` apart are
refused, as they are not one run (an output folder can keep an earlier run's file when a stage did not run).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path

Key = tuple[int, int, int]  # (n_prompt, n_gen, n_depth)
MAX_APART = timedelta(hours=1)


def medians(rows: Sequence[Mapping]) -> dict[Key, float]:
    """Median tok/s of each test of a llama-bench or lily bench JSON list (both use llama-bench's keys)."""
    out: dict[Key, float] = {}
    for row in rows:
        samples = row.get("samples_ts") or [row["avg_ts"]]
        out[(int(row["n_prompt"]), int(row["n_gen"]), int(row["n_depth"]))] = statistics.median(samples)
    return out


def measured(rows: Sequence[Mapping]) -> tuple[datetime, datetime] | None:
    """The first and last ``test_time`` of a bench JSON list (llama-bench's ``2026-12-05T21:53:11Z``), or None."""
    times = [datetime.strptime(row["test_time"], "%Y-%m-%dT%H:%M:%SZ") for row in rows if row.get("test_time")]
    return (min(times), max(times)) if times else None


def label(key: Key) -> str:
    n_prompt, n_gen, depth = key
    name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return f"{name} @ d{depth}" if depth else name


def table(peer: Mapping[Key, float], lily: Mapping[Key, float], bytes_per_token: Mapping[int, float],
          bandwidth: float) -> str:
    """The markdown table; ``bytes_per_token`` by depth, ``bandwidth`` in bytes per second."""
    header = ("| test | llama.cpp tok/s | GB/s | of bound | Lily tok/s | GB/s | of bound | Lily / llama.cpp |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [header]
    for key in sorted(set(peer) | set(lily), key=lambda k: (k[2], k[1] > 0, k[0], k[1])):
        cells = [label(key)]
        for side in (peer, lily):
            rate = side.get(key)
            if rate is None:
                cells += ["-", "-", "-"]
            elif key[1] and key[2] in bytes_per_token:
                moved = rate * bytes_per_token[key[2]]
                cells += [f"{rate:,.1f}", f"{moved / 1e9:,.0f}", f"{moved / bandwidth:.1%}"]
            else:
                cells += [f"{rate:,.1f}", "", ""]
        ratio = lily[key] / peer[key] if key in lily and key in peer else None
        cells.append(f"{ratio:.2f}x" if ratio is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])

    def read(name: str):
        path = out / name
        return json.loads(path.read_text()) if path.is_file() else None

    peer, lily = read("llama-bench.json") or [], read("lily-bench.json") or []
    plan, copy = read("plan.json") or {}, read("bandwidth.json")
    if copy is None:
        print(f"{out / 'bandwidth.json'} is missing: run the bandwidth stage first", file=sys.stderr)
        return 1
    spans = {"llama.cpp": measured(peer), "Lily": measured(lily)}
    known = [span for span in spans.values() if span]
    apart = max(known[0][0], known[1][0]) - min(known[0][1], known[1][1]) if len(known) == 2 else timedelta(0)
    when = ", ".join(f"{side} {span[0]:%Y-%m-%d %H:%M}-{span[1]:%H:%M} UTC" if span else f"{side} not dated"
                     for side, span in spans.items())
    if apart > MAX_APART:
        print(f"llama-bench.json and lily-bench.json in {out} were measured {apart} apart ({when}): not one run; "
              "rerun the older side's stage", file=sys.stderr)
        return 1
    bytes_per_token = {int(depth): float(total) for depth, total in plan.items()}
    print(table(medians(peer), medians(lily), bytes_per_token, float(copy["bytes_per_second"])))
    print(f"\nmeasured: {when}")
    print(f"\nbandwidth bound: device-to-device copy {copy['bytes_per_second'] / 1e12:.2f} TB/s (read + write), "
          f"{copy.get('how', '')}; bytes per decode token from lily plan at the test's depth: "
          + ", ".join(f"d{d} {b / 1e9:.3f} GB" for d, b in sorted(bytes_per_token.items())))
    sampled = read("sampled.json")
    if sampled is not None:
        print("\n" + load_sampled().summary(sampled))
    return 0


def load_sampled():
    """sampled.py beside this script (its summary line), imported by path as the scripts are not a package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_bench_sampled", Path(__file__).with_name("sampled.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(main())
