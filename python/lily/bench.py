"""``lily bench``: prompt-processing and generation throughput, in llama-bench's conventions.

Tests are named ``pp<N>`` (prefill N tokens), ``tg<N>`` (generate N tokens) and, at a context
depth D (D tokens already in the sequence), ``pp<N> @ d<D>``. Prompts are random token ids from
a fixed seed; end tokens do not stop generation; tokenization and detokenization are not timed.
Each test runs ``repetitions`` times after one untimed warm-up run of its own (``--no-warmup``: none); rows report
mean ± sample sd of t/s.

``host_cost`` (``lily bench --full-size --host-only``) measures the host's own cost per decode token on the
full-size graph with the kernels stubbed out (Linux test runtime): the Python iterator of ``Session.decode``, the
engine's encode and the command-buffer bookkeeping, against the budget of a token at 275 tok/s.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lily.backends import ExpertCounts, KernelProfiling, LiveSequence, host_memory_gb, peak_memory_gb
from lily.model import Model, Session


@dataclass
class BenchRow:
    """One test's samples; keys follow llama-bench's JSON output (``test_time``: when the test started, UTC, in
    llama-bench's format), plus mlx-style ``peak_memory`` (GB: on a GPU backend the most the engine has held in GPU
    memory, else the process's peak RSS) and ``host_memory`` (GB, the process's peak RSS)."""

    test: str
    n_prompt: int
    n_gen: int
    n_depth: int
    test_time: str = ""
    samples_ns: list[int] = field(default_factory=list)
    samples_ts: list[float] = field(default_factory=list)
    peak_memory: float = 0.0
    host_memory: float = 0.0

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


def _make_live(model: Model, session: Session) -> None:
    """The GPU backends hold one sequence's state on the device: make the fork's the live one before a clock starts,
    as llama-bench runs each test in a context of its own (at depth 32768 the swap moves over a gigabyte between
    host and device, which is neither prefill nor decode: on an H200 it cut tg128 @ d32768 from 190 to 66 tok/s)."""
    if isinstance(model.backend, LiveSequence):
        model.backend.activate(session.state)


def _time_prefill(model: Model, base: Session, ids: list[int]) -> float:
    session = base.fork()
    _make_live(model, session)
    start = time.perf_counter()
    model.prefill(ids, session=session, use_cache=False)
    return time.perf_counter() - start


# Plain greedy, as llama-bench: no generation_config penalty (decode applies it unless told otherwise).
GREEDY_DECODE = {"temperature": 0.0, "repetition_penalty": 1.0}
# The sampled decode the peer run times beside greedy (issue 21's bar: within 5 % of it).
SAMPLED_DECODE = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 1, "repetition_penalty": 1.0}
SAMPLED_DECODE_NAME = "T {temperature}, top-p {top_p}, top-k {top_k}".format(**SAMPLED_DECODE)


def _time_generate(model: Model, base: Session, n_gen: int, first: int,
                   options: dict[str, Any] | None = None) -> float:
    """Seconds for n_gen tokens decoded from a fork of `base` (greedy unless `options` are other decode options)."""
    session = base.fork()
    if len(session) == 0:
        model.prefill([first], session=session, use_cache=False)
    else:
        session._ensure_logits()
    _make_live(model, session)
    tokens = session.decode(max_tokens=n_gen, stop_token_ids=(), **(GREEDY_DECODE if options is None else options))
    start = time.perf_counter()
    for _ in tokens:
        pass
    if session._pending:
        session._ensure_logits()  # CPU sampling: the n-th forward pass (a GPU decode ran it before stopping)
    return time.perf_counter() - start


def context_needed(prompts: Sequence[int], gens: Sequence[int], depths: Sequence[int]) -> int | None:
    """The KV-cache limit the tests need (the deepest test: its depth, its prompt or generation, and the token after
    it), or None where the engine backends' default limit (32768) holds them."""
    from lily.backends.engine import DEFAULT_MAX_CONTEXT

    needed = max(depths, default=0) + max([*prompts, *gens], default=0) + 1
    return needed if needed > DEFAULT_MAX_CONTEXT else None


def run_bench(model: Model, *, prompts: Sequence[int] = (512,), gens: Sequence[int] = (128,),
              depths: Sequence[int] = (0,), repetitions: int = 5, seed: int = 0, warmup: bool = True,
              progress: Any = None, finished: Any = None) -> list[BenchRow]:
    """Run every pp/tg test at every depth; ``progress(row_name)`` is called before each test and
    ``finished(row)`` after it, so a caller can show each result as it comes (a full-size run takes minutes).
    With ``warmup`` each test first runs once untimed, as llama-bench's do: a shape's first run pays for what the
    backend builds once (a GPU backend's graphs: on an H200 a 1-token prefill took 12.7 ms the first time, 3.2
    after)."""
    for name, values in (("-p", prompts), ("-n", gens), ("-d", depths)):
        if any(v < 0 for v in values):
            raise ValueError(f"{name} values must be >= 0; got {list(values)}")
    if repetitions < 1:
        raise ValueError(f"-r must be >= 1; got {repetitions}")
    limit = model.config.max_position_embeddings
    rng = np.random.default_rng(seed)
    rows: list[BenchRow] = []
    for depth in depths:
        base = _depth_session(model, depth, rng)
        tests = [(p, 0) for p in prompts if p] + [(0, n) for n in gens if n]
        for n_prompt, n_gen in tests:
            if depth + n_prompt + n_gen + 1 > limit:
                raise ValueError(f"{test_label(n_prompt, n_gen, depth)} needs more than the model's "
                                 f"context of {limit} tokens")
            row = BenchRow(test_label(n_prompt, n_gen, depth), n_prompt, n_gen, depth,
                           time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            if progress is not None:
                progress(row.test)
            for repetition in range(-1 if warmup else 0, repetitions):
                if n_prompt:
                    seconds = _time_prefill(model, base, _random_ids(model, n_prompt, rng))
                else:
                    seconds = _time_generate(model, base, n_gen, _random_ids(model, 1, rng)[0])
                if repetition < 0:
                    continue  # the warm-up
                row.samples_ns.append(int(seconds * 1e9))
                row.samples_ts.append((n_prompt or n_gen) / seconds if seconds > 0 else math.inf)
            row.peak_memory = peak_memory_gb(model.backend)
            row.host_memory = host_memory_gb()
            rows.append(row)
            if finished is not None:
                finished(row)
    return rows


@dataclass
class ExpertLoad:
    """Routed (token, slot) pairs per layer and expert over one prefill of ``tokens`` tokens, counted by ``backend``."""

    tokens: int
    top_k: int
    backend: str
    counts: np.ndarray  # [layers, experts]

    def summary(self) -> dict[str, Any]:
        """Experts used (fewest in any layer), the busiest expert's tokens (most in any layer, and where) and the
        mean tokens per expert (tokens x top-k / experts)."""
        layers, experts = self.counts.shape
        busiest_layer = int(self.counts.max(axis=1).argmax())
        return {"tokens": self.tokens, "backend": self.backend, "experts": experts,
                "min_experts_used": int((self.counts > 0).sum(axis=1).min()),
                "max_expert_tokens": int(self.counts.max()), "busiest_layer": busiest_layer,
                "mean_expert_tokens": self.tokens * self.top_k / experts}


def expert_load(model: Model, tokens: int, *, seed: int = 0) -> ExpertLoad | None:
    """The expert load of one ``tokens``-token prefill of random ids, counted by a backend that counts routing (the
    cpu backend): the model's own, else, for dummy weights, a cpu backend over the same weights, built for this and
    dropped after. None where neither exists (no counting backend, or real weights on another backend)."""
    from lily import _ext
    from lily.backends.cpu import CpuBackend
    from lily.dummy import dummy_checkpoint

    backend = model.backend
    if not isinstance(backend, ExpertCounts):
        if model.load_format != "dummy" or not hasattr(_ext, "cpu"):
            return None
        backend = CpuBackend(dummy_checkpoint(model.config))  # same config and seed: the same weights
    ids = np.asarray(_random_ids(model, tokens, np.random.default_rng(seed)), dtype=np.int64)
    backend.expert_tokens(reset=True)
    state = backend.new_state()
    step = model.prefill_step_size
    for start in range(0, tokens, step):
        backend.forward(ids[start:start + step], state, last_only=True)
    return ExpertLoad(tokens, model.config.num_experts_per_tok, "cpu", backend.expert_tokens(reset=True))


def format_expert_load(load: ExpertLoad) -> str:
    """One line: experts used and the busiest expert against the mean."""
    s = load.summary()
    return (f"expert load over a {s['tokens']}-token prefill ({s['backend']} backend, same weights): at least "
            f"{s['min_experts_used']}/{s['experts']} experts used in every layer; busiest expert "
            f"{s['max_expert_tokens']} tokens (layer {s['busiest_layer']}) vs a mean of {s['mean_expert_tokens']:.1f} "
            f"({s['max_expert_tokens'] / s['mean_expert_tokens']:.1f}x)")


def _count_label(n: float) -> str:
    """llama.cpp's size labels: 35B, 3B, 27M, 12K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{round(n / scale)}{unit}"
    return str(int(n))


_DTYPE_LABELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def model_description(model: Model, n_params: int, weights: Any = None) -> str:
    """llama-bench's model column: architecture, total.Active parameter labels and quantization,
    e.g. "qwen3_5_moe 35B.A3B 4-bit" ("... 4-bit dummy" for dummy weights). ``weights``: the model's (default: its
    backend's)."""
    weights = weights if weights is not None else model.backend.weights
    names = list(weights) if hasattr(weights, "shape") else []
    experts = sum(int(np.prod(weights.shape(n))) for n in names if ".switch_mlp." in n)
    config = model.config
    share = getattr(config, "num_experts_per_tok", 0) / max(getattr(config, "num_experts", 0), 1)
    active = n_params - experts * (1 - share)
    size = _count_label(n_params) + (f".A{_count_label(active)}" if experts else "")
    bits = statistics.multimode(q[0] for n in names if (q := weights.quantization(n)) is not None)
    dtypes = statistics.multimode(weights.dtype(n) for n in names) or ["unknown"]
    kind = f"{bits[0]}-bit" if bits else _DTYPE_LABELS.get(dtypes[0], dtypes[0])
    return f"qwen3_5_moe {size} {kind}" + (" dummy" if model.load_format == "dummy" else "")


def model_info(model: Model) -> dict[str, Any]:
    """Model description, file size and parameter count, as llama-bench's leading columns; for dummy weights the
    size is what a checkpoint of them would hold (no file exists)."""
    path = Path(model.path) if model.path is not None else None
    weights = model.backend.weights
    if model.load_format == "dummy":
        from lily.dummy import dummy_checkpoint

        weights = dummy_checkpoint(model.config).weights  # names, shapes and dtypes only: nothing is generated
        size = stored_bytes(weights)
    else:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path else 0
    params = sum(int(np.prod(weights.shape(name))) for name in weights) if hasattr(weights, "shape") else 0
    return {"model_filename": str(path) if path else "", "model_type": model_description(model, params, weights),
            "model_size": size, "model_n_params": params, "backends": model.backend_name,
            "load_format": model.load_format, **build_info()}


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def stored_bytes(weights: Any) -> int:
    """Bytes of ``weights`` as a checkpoint stores them: packed codes plus a scale and a bias per group in the
    tensor's dtype, dense tensors in theirs."""
    total = 0
    for name in weights:
        count = int(np.prod(weights.shape(name)))
        item = _DTYPE_BYTES[weights.dtype(name)]
        quantization = weights.quantization(name)
        if quantization is None:
            total += count * item
        else:
            bits, group = quantization
            total += count * bits // 8 + 2 * (count // group) * item
    return total


def build_info() -> dict[str, str]:
    """The lily version and the commit it was built from (llama-bench's build_commit; ``lily._build``)."""
    from lily import __version__, _build

    return {"build_commit": _build.COMMIT, "lily_version": __version__}


def system_info() -> str:
    """A one-line hardware/OS/version footer."""
    return (f"{platform.machine()} {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, numpy {np.__version__}")


# llama-bench's minimum column widths; text columns are left-aligned, numbers right-aligned.
_COLUMNS = (("model", 30, "<"), ("size", 10, ">"), ("params", 10, ">"), ("backend", 10, "<"),
            ("test", 15, ">"), ("t/s", 20, ">"), ("peak GB", 7, ">"),
            ("host GB", 7, ">"))


def format_markdown(rows: Sequence[BenchRow], info: dict[str, Any]) -> str:
    """The llama-bench markdown table (padded columns), plus peak and host memory (GB), then the
    ``build:`` line and a system footer."""
    table = [[info["model_type"], f"{info['model_size'] / 2**30:.2f} GiB", f"{info['model_n_params'] / 1e9:.2f} B",
              info["backends"], row.test, f"{row.avg_ts:.2f} ± {row.stddev_ts:.2f}", f"{row.peak_memory:.2f}",
              f"{row.host_memory:.2f}"]
             for row in rows]
    widths = [max([minimum, len(name)] + [len(cells[i]) for cells in table])
              for i, (name, minimum, _) in enumerate(_COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(f"{c:{a}{w}}" for c, w, (_, _, a) in zip(cells, widths, _COLUMNS)) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + (":" if a == ">" else "-") for w, (_, _, a) in zip(widths, _COLUMNS))
    lines = [line([name for name, _, _ in _COLUMNS]), rule + " |", *(line(cells) for cells in table)]
    lines += ["", f"build: {info['build_commit']} (lily {info['lily_version']})", system_info()]
    return "\n".join(lines)


def require_profiling(model: Model, n_prompt: int) -> None:
    """ValueError, before any benchmark runs, where ``profile_prefill`` cannot: not the cuda backend, or a prompt
    too short to be a prefill."""
    if not (isinstance(model.backend, KernelProfiling) and model.backend.supports_profiling):
        raise ValueError(f"--profile needs the cuda or cpu backend (per-node times); this model runs on "
                         f"{model.backend_name!r}")
    if n_prompt < 2:
        raise ValueError(f"--profile times one prefill, which must be at least 2 tokens (--profile N, or the "
                         f"largest -p without N); got {n_prompt}")


def profile_prefill(model: Model, n_prompt: int, seed: int = 0) -> list[tuple[str, str, float]]:
    """Per-node device times of one prefill of ``n_prompt`` random tokens (``EngineBackend.profile_prefill``)."""
    require_profiling(model, n_prompt)
    return model.backend.profile_prefill(_random_ids(model, n_prompt, np.random.default_rng(seed)))


def format_profile(times: Sequence[tuple[str, str, float]], n_prompt: int) -> str:
    """A markdown table of ``profile_prefill``'s times by kernel, most time first: launches, total, share, mean."""
    totals: dict[str, list[float]] = {}
    for kernel, _, ms in times:
        totals.setdefault(kernel, []).append(ms)
    device = sum(ms for _, _, ms in times)
    lines = [f"device time of a {n_prompt}-token prefill, node by node: {device:.2f} ms over {len(times)} launches",
             "| kernel | launches | total ms | share | mean µs |", "| --- | ---: | ---: | ---: | ---: |"]
    for kernel, samples in sorted(totals.items(), key=lambda item: -sum(item[1])):
        total = sum(samples)
        lines.append(f"| `{kernel}` | {len(samples)} | {total:.3f} | {100 * total / (device or 1):.1f}% | "
                     f"{1e3 * total / len(samples):.1f} |")
    return "\n".join(lines)


def format_json(rows: Sequence[BenchRow], info: dict[str, Any]) -> str:
    """A JSON list with one object per test (llama-bench ``-o json`` keys)."""
    return json.dumps([{**info, **row.as_dict()} for row in rows], indent=2)


# A token at the target of 275 tok/s (performance.md) has 3.6 ms in all; the host's share must stay far below.
HOST_BUDGET_US = {"host_us_per_token": 100.0, "cpp_us_per_token": 30.0}


def host_cost(*, tokens: int = 256, precision: str = "bfloat16", warmup: int = 16, rounds: int = 1) -> dict[str, Any]:
    """Host microseconds per decode token of the full-size model, kernels stubbed out (median over ``tokens``).

    The decode runs through ``Session.decode`` (greedy, the GPU token path) on a metal backend over synthetic
    weights, with the fake Metal recording every dispatch but running none. ``host_us_per_token``: time between
    two tokens of the iterator, all host work included; ``encode_us_per_token``: finding the built step, encoding it
    with its Metal calls (which here go to the toy Objective-C runtime and fake Metal) and committing it, timed in the
    same steps; ``cpp_us_per_token``: the engine's own C++ (the same encode into an encoder that makes no Metal call),
    timed in a second decode over the same contexts (each step is then encoded twice, which would slow the tokens).
    ``rounds`` measurements on one engine are reported by the quietest (least host time per token), with every
    round's median in ``rounds_host_us``: a shared machine's CPU speed swings (about 2x, for seconds at a time, on
    the 2-core build machines), and the least disturbed round is the one that measures Lily.
    Needs the Linux test runtime (on a Mac, kernels cannot be stubbed).
    """
    from lily import _ext
    from lily.backends.metal import TEST_BUILD_INSTALL, MetalBackend
    from lily.plan import full_size_args

    if tokens < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"tokens and rounds must be >= 1 and warmup >= 0; got {tokens}, {rounds}, {warmup}")
    if getattr(_ext, "platform", "") == "metal":
        raise ValueError("--host-only needs the Linux test runtime (kernels are stubbed in its fake Metal); on a "
                         "Mac, run lily bench on a real checkpoint")
    stubs = getattr(_ext, "_test_engine", None)
    if stubs is None or not hasattr(stubs, "set_kernel_execution"):
        raise ValueError("--host-only needs the Linux Metal test runtime (kernels are stubbed in its fake Metal), "
                         f"which only a test build links: {TEST_BUILD_INSTALL}")
    args = full_size_args()
    # Kernels run while the engine loads: its simdgroup_matrix layout probe passes as on an Apple GPU, so the step is
    # the one a Mac runs (attention on matrix units); every dispatch after that is stubbed.
    backend = MetalBackend.synthetic(args, precision=precision, max_context=warmup + tokens + 8)
    stubs.set_kernel_execution(False)
    try:
        model = Model(backend, args, None, backend_name="metal", fingerprint="synthetic")

        def decode(timing: str) -> tuple[list[int], list[int]]:
            """Token arrival times and the step times of ``timing`` ("encode" or "cpp") after the warm-up."""
            stamps = []
            session = model.prefill([0], use_cache=False)
            backend.host_timing(encode=False)
            for _ in session.decode(max_tokens=warmup + tokens + 1, temperature=0.0, stop_token_ids=()):
                if len(stamps) == warmup:
                    backend.host_timing(encode=timing == "encode", cpp=timing == "cpp")
                stamps.append(time.perf_counter_ns())
            return stamps, backend.host_timing(encode=False)[timing]

        def measure() -> dict[str, float]:
            """One round: two decodes over the same contexts, the first timing the tokens and their encodes, the
            second the dry encodes (each step is then encoded twice, which would slow the tokens)."""
            stamps, encode_ns = decode("encode")
            _, cpp_ns = decode("cpp")
            between = np.diff(np.asarray(stamps[warmup:], dtype=np.float64))
            return {"tokens": int(between.size), "host_us_per_token": float(np.median(between) / 1e3),
                    "cpp_us_per_token": float(np.median(cpp_ns) / 1e3),
                    "encode_us_per_token": float(np.median(encode_ns) / 1e3)}

        measured = [measure() for _ in range(rounds)]
        dispatches = backend.last_step_counts()["dispatches"]
    finally:
        stubs.set_kernel_execution(True)
    quietest = min(measured, key=lambda r: r["host_us_per_token"])
    return {
        "model": "Qwen3.6-35B-A3B (synthetic weights, kernels stubbed)",
        "precision": precision,
        **quietest,
        "dispatches_per_token": int(dispatches),
        "rounds": rounds,
        "rounds_host_us": [round(r["host_us_per_token"], 1) for r in measured],
        "budget_us": HOST_BUDGET_US,
        "system": system_info(),
    }


def format_host_cost(result: dict[str, Any]) -> str:
    """The host-cost figures next to their budgets, one per line."""
    lines = [f"host cost per decode token, {result['model']}, {result['precision']}, median of "
             f"{result['tokens']} tokens, {result['dispatches_per_token']} dispatches per token"]
    if result["rounds"] > 1:
        lines.append(f"  the quietest of {result['rounds']} rounds (the median round: "
                     f"{statistics.median(result['rounds_host_us']):.1f} us of all host work)")
    for key, label in (("host_us_per_token", "all host work (Python iterator + engine + command buffers)"),
                       ("cpp_us_per_token", "engine C++ (find the built step, patch, encode; no Metal calls)")):
        lines.append(f"  {label}: {result[key]:.1f} us (budget {result['budget_us'][key]:.0f} us)")
    lines.append(f"  encode with its Metal calls (here: the Linux test runtime's): {result['encode_us_per_token']:.1f} us")
    lines.append(result["system"])
    return "\n".join(lines)
