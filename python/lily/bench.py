"""``lily bench``: prompt-processing and generation throughput, in llama-bench's conventions.

Tests are named ``pp<N>`` (prefill N tokens), ``tg<N>`` (generate N tokens) and, at a context
depth D (D tokens already in the sequence), ``pp<N> @ d<D>``. Prompts are random token ids from
a fixed seed; end tokens do not stop generation; tokenization and detokenization are not timed.
Each test runs ``repetitions`` times after one warm-up; rows report mean ± sample sd of t/s.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lily.model import Model, Session, peak_memory_gb


@dataclass
class BenchRow:
    """One test's samples; keys follow llama-bench's JSON output, plus mlx-style peak_memory (GB)."""

    test: str
    n_prompt: int
    n_gen: int
    n_depth: int
    samples_ns: list[int] = field(default_factory=list)
    samples_ts: list[float] = field(default_factory=list)
    peak_memory: float = 0.0

    @property
    def avg_ts(self) -> float:
        """Mean tokens per second over the repetitions."""
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        """Sample standard deviation of tokens per second (0 for a single repetition)."""
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The llama-bench JSON keys of this row."""
        out = asdict(self)
        out.update(avg_ts=self.avg_ts, stddev_ts=self.stddev_ts,
                   avg_ns=int(statistics.fmean(self.samples_ns)),
                   stddev_ns=int(statistics.stdev(self.samples_ns)) if len(self.samples_ns) > 1 else 0)
        return out


def test_label(n_prompt: int, n_gen: int, n_depth: int) -> str:
    """``pp512``, ``tg128`` or ``pp512 @ d4096``."""
    name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return f"{name} @ d{n_depth}" if n_depth else name


def _random_ids(model: Model, count: int, rng: np.random.Generator) -> list[int]:
    high = model.tokenizer.vocab_size if model.tokenizer is not None else model.config.vocab_size
    high = min(high, model.config.vocab_size)
    return rng.integers(0, high, size=count).tolist()


def _depth_session(model: Model, depth: int, rng: np.random.Generator) -> Session:
    session = model.new_session(use_cache=False)
    if depth:
        model.prefill(_random_ids(model, depth, rng), session=session, use_cache=False)
    return session


def _time_prefill(model: Model, base: Session, ids: list[int]) -> float:
    session = base.fork()
    start = time.perf_counter()
    model.prefill(ids, session=session, use_cache=False)
    return time.perf_counter() - start


def _time_generate(model: Model, base: Session, n_gen: int, first: int) -> float:
    session = base.fork()
    if len(session) == 0:
        model.prefill([first], session=session, use_cache=False)
    else:
        session._ensure_logits()
    # Plain greedy, as llama-bench: no generation_config penalty (decode applies it unless told otherwise).
    tokens = session.decode(max_tokens=n_gen, temperature=0.0, repetition_penalty=1.0, stop_token_ids=())
    start = time.perf_counter()
    for _ in tokens:
        pass
    session._ensure_logits()  # the n-th forward pass: the first token came from existing logits
    return time.perf_counter() - start


def run_bench(model: Model, *, prompts: Sequence[int] = (512,), gens: Sequence[int] = (128,),
              depths: Sequence[int] = (0,), repetitions: int = 5, seed: int = 0,
              progress: Any = None) -> list[BenchRow]:
    """Run every pp/tg test at every depth; ``progress(row_name)`` is called before each test."""
    for name, values in (("-p", prompts), ("-n", gens), ("-d", depths)):
        if any(v < 0 for v in values):
            raise ValueError(f"{name} values must be >= 0; got {list(values)}")
    if repetitions < 1:
        raise ValueError(f"-r must be >= 1; got {repetitions}")
    limit = model.config.max_position_embeddings
    rng = np.random.default_rng(seed)
    rows: list[BenchRow] = []
    _time_prefill(model, model.new_session(use_cache=False), _random_ids(model, 8, rng))  # warm-up
    for depth in depths:
        base = _depth_session(model, depth, rng)
        tests = [(p, 0) for p in prompts if p] + [(0, n) for n in gens if n]
        for n_prompt, n_gen in tests:
            if depth + n_prompt + n_gen + 1 > limit:
                raise ValueError(f"{test_label(n_prompt, n_gen, depth)} needs more than the model's "
                                 f"context of {limit} tokens")
            row = BenchRow(test_label(n_prompt, n_gen, depth), n_prompt, n_gen, depth)
            if progress is not None:
                progress(row.test)
            for _ in range(repetitions):
                if n_prompt:
                    seconds = _time_prefill(model, base, _random_ids(model, n_prompt, rng))
                else:
                    seconds = _time_generate(model, base, n_gen, _random_ids(model, 1, rng)[0])
                row.samples_ns.append(int(seconds * 1e9))
                row.samples_ts.append((n_prompt or n_gen) / seconds if seconds > 0 else math.inf)
            row.peak_memory = peak_memory_gb(model.backend)
            rows.append(row)
    return rows


def _count_label(n: float) -> str:
    """llama.cpp's size labels: 35B, 3B, 27M, 12K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{round(n / scale)}{unit}"
    return str(int(n))


_DTYPE_LABELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def model_description(model: Model, n_params: int) -> str:
    """llama-bench's model column: architecture, total.Active parameter labels and quantization,
    e.g. "qwen3_5_moe 35B.A3B 4-bit"."""
    weights = getattr(model.backend, "weights", None)
    names = list(weights) if hasattr(weights, "shape") else []
    experts = sum(int(np.prod(weights.shape(n))) for n in names if ".switch_mlp." in n)
    config = model.config
    share = getattr(config, "num_experts_per_tok", 0) / max(getattr(config, "num_experts", 0), 1)
    active = n_params - experts * (1 - share)
    size = _count_label(n_params) + (f".A{_count_label(active)}" if experts else "")
    bits = statistics.multimode(q[0] for n in names if (q := weights.quantization(n)) is not None)
    dtypes = statistics.multimode(weights.dtype(n) for n in names) or ["unknown"]
    kind = f"{bits[0]}-bit" if bits else _DTYPE_LABELS.get(dtypes[0], dtypes[0])
    return f"qwen3_5_moe {size} {kind}"


def model_info(model: Model) -> dict[str, Any]:
    """Model description, file size and parameter count, as llama-bench's leading columns."""
    path = Path(model.path) if model.path is not None else None
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path else 0
    weights = getattr(model.backend, "weights", {})
    params = sum(int(np.prod(weights.shape(name))) for name in weights) if hasattr(weights, "shape") else 0
    return {"model_filename": str(path) if path else "", "model_type": model_description(model, params),
            "model_size": size, "model_n_params": params, "backends": model.backend_name,
            **build_info()}


def build_info() -> dict[str, str]:
    """The lily version and, in a git checkout, its commit (llama-bench's build_commit)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        lily_version = version("lily")
    except PackageNotFoundError:
        lily_version = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"build_commit": commit or "unknown", "lily_version": lily_version}


def system_info() -> str:
    """A one-line hardware/OS/version footer."""
    return (f"{platform.machine()} {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, numpy {np.__version__}")


# llama-bench's minimum column widths; text columns are left-aligned, numbers right-aligned.
_COLUMNS = (("model", 30, "<"), ("size", 10, ">"), ("params", 10, ">"), ("backend", 10, "<"),
            ("test", 15, ">"), ("t/s", 20, ">"), ("peak GB", 7, ">"))


def format_markdown(rows: Sequence[BenchRow], info: dict[str, Any]) -> str:
    """The llama-bench markdown table (padded columns), plus peak memory (GB), then the
    ``build:`` line and a system footer."""
    table = [[info["model_type"], f"{info['model_size'] / 2**30:.2f} GiB", f"{info['model_n_params'] / 1e9:.2f} B",
              info["backends"], row.test, f"{row.avg_ts:.2f} ± {row.stddev_ts:.2f}", f"{row.peak_memory:.2f}"]
             for row in rows]
    widths = [max([minimum, len(name)] + [len(cells[i]) for cells in table])
              for i, (name, minimum, _) in enumerate(_COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(f"{c:{a}{w}}" for c, w, (_, _, a) in zip(cells, widths, _COLUMNS)) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + (":" if a == ">" else "-") for w, (_, _, a) in zip(widths, _COLUMNS))
    lines = [line([name for name, _, _ in _COLUMNS]), rule + " |", *(line(cells) for cells in table)]
    lines += ["", f"build: {info['build_commit']} (lily {info['lily_version']})", system_info()]
    return "\n".join(lines)


def format_json(rows: Sequence[BenchRow], info: dict[str, Any]) -> str:
    """A JSON list with one object per test (llama-bench ``-o json`` keys)."""
    return json.dumps([{**info, **row.as_dict()} for row in rows], indent=2)
