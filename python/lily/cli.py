"""The ``lily`` command: generate, chat, serve, bench, download, plan.

Without ``--model`` every command uses the embedded demo model ``lily:demo``. Errors print one
line (``lily: error: ...``) and exit with status 1; Ctrl-C exits with 130, except in ``lily chat``,
where it stops the answer (or clears the line) and keeps the conversation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from lily.sampling import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_TOKENS, SamplingParams
from lily.server.scheduler import DEFAULT_MAX_QUEUE  # lily.server loads Starlette lazily: `lily --help` stays light

DEFAULT_MODEL = "lily:demo"


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="checkpoint directory, Hugging Face repo id, or lily:demo (default)")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "metal", "cuda", "cpu"),
                   help="engine backend (default: auto)")
    p.add_argument("--precision", default=None, choices=("bfloat16", "float32"),
                   help="metal backend activations (default: the backend's own, bfloat16 for metal)")


def _add_sampling_flags(p: argparse.ArgumentParser, *, max_tokens_help: str) -> None:
    p.add_argument("--max-tokens", type=int, default=None, help=f"tokens to generate (default {max_tokens_help})")
    p.add_argument("--temperature", "--temp", type=float, default=None,
                   help="sampling temperature; 0 is greedy (default: the model's generation_config, else 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="(default: generation_config, else 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="(default: generation_config, else 0: off)")
    p.add_argument("--min-p", type=float, default=None, help="(default: generation_config, else 0.0: off)")
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=None,
                   help="(default: generation_config, else 1.0: off)")
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _add_thinking_flag(p: argparse.ArgumentParser, scope: str) -> None:
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help=f"think before answering, or not{scope} (default: the model's chat template: on for "
                        "Qwen3.6, off for lily:demo)")


def _sampling(model: Any, args: argparse.Namespace, *, chat: bool) -> SamplingParams:
    """The one ``SamplingParams`` of the flags given, built by the model as for Python (``Model.sampling_params``:
    its generation_config.json, then Lily's defaults, supply the rest; see ``lily.sampling``) and checked once."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "stop")
    return model.sampling_params(chat=chat, **{name: getattr(args, name) for name in names
                                               if getattr(args, name) is not None})


def _load(args: argparse.Namespace, max_context: int | None = None) -> Any:
    from lily import Model

    print(f"Loading {args.model} ...", file=sys.stderr, flush=True)
    return Model.load(args.model, backend=args.backend, precision=args.precision, max_context=max_context)


def _print_stats(stats: Any, out: TextIO) -> None:
    print(f"Prompt: {stats.prompt_tokens} tokens ({stats.cached_tokens} cached), "
          f"{stats.prompt_tps:.3f} tokens-per-sec", file=out)
    print(f"Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec", file=out)
    print(f"Peak memory: {stats.peak_memory:.3f} GB", file=out)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a continuation (or, with --chat, an answer) of PROMPT to stdout; stats to stderr."""
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read() if not sys.stdin.isatty() or prompt == "-" else "\n"
    if not prompt:
        raise ValueError("the prompt is empty")
    model = _load(args)
    sampling = _sampling(model, args, chat=args.chat)
    last = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        printer = _ChatPrinter(sys.stdout)
        for last in model.chat(messages, sampling=sampling, enable_thinking=args.thinking, stream=True):
            printer.write("reasoning", last.reasoning)
            printer.write("content", last.content)
        printer.finish()
    else:
        for last in model.generate(prompt, sampling=sampling, stream=True):
            sys.stdout.write(last.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if _filled_the_context(model, last):
        print(f"[stopped at the end of the model's context ({model.config.max_position_embeddings} tokens)]",
              file=sys.stderr)
    if last is not None:
        _print_stats(last.stats, sys.stderr)
    return 0


def _filled_the_context(model: Any, last: Any) -> bool:
    """Whether a generation ended because prompt and answer filled the model's context (not at max_tokens)."""
    return (last is not None and last.finish_reason == "length"
            and last.stats.prompt_tokens + last.stats.generation_tokens >= model.config.max_position_embeddings)


class _ChatPrinter:
    """Prints reasoning dimmed on a terminal (prefixed ``[thinking]`` / ``[answer]`` otherwise),
    apart from the answer."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.channel = ""

    def _switch(self, channel: str) -> None:
        if self.channel == "reasoning":
            self.out.write("\033[0m\n" if self.tty else "\n")
        if channel and not self.tty:
            self.out.write(f"[{'thinking' if channel == 'reasoning' else 'answer'}] ")
        if channel == "reasoning" and self.tty:
            self.out.write("\033[2m")
        self.channel = channel

    def write(self, channel: str, text: str) -> None:
        """Show a piece of the reasoning or of the answer."""
        if not text:
            return
        if channel != self.channel:
            self._switch(channel)
        self.out.write(text)
        self.out.flush()

    def finish(self) -> None:
        """Close an open reasoning block."""
        self._switch("")


def _line_editing() -> None:
    """Arrow keys, history and long pastes at the prompt: the standard library's readline puts the
    terminal in raw mode, so lines are not cut at the tty's 4,095-byte canonical-mode limit."""
    try:
        import readline  # noqa: F401 - importing it is what turns line editing on for input()
    except ImportError:  # Python built without readline: plain input() still works
        pass


def _chat_turn(model: Any, messages: list[dict[str, Any]], args: argparse.Namespace,
               sampling: SamplingParams) -> dict[str, Any] | None:
    """Prefill and stream one answer; the assistant message to keep, or None when there is none
    (Ctrl-C during the prefill, or a prompt the model cannot take)."""
    try:
        tokens = model.chat(messages, sampling=sampling, enable_thinking=args.thinking,
                            preserve_thinking=args.preserve_thinking, stream=True)
    except KeyboardInterrupt:
        print("\n[interrupted before the answer: the message was not added; the conversation is kept]",
              file=sys.stderr)
        return None
    except ValueError as exc:  # over the context, an unreadable message: report, keep the chat open
        print(f"lily: error: {exc} (the message was not added; /reset clears the conversation)", file=sys.stderr)
        return None
    printer = _ChatPrinter(sys.stdout)
    reasoning, content, calls, last = [], [], [], None
    try:
        for token in tokens:
            printer.write("reasoning", token.reasoning)
            printer.write("content", token.content)
            reasoning.append(token.reasoning)
            content.append(token.content)
            calls.extend(token.tool_calls)
            last = token
    except KeyboardInterrupt:  # Ctrl-C ends this answer, not the chat
        tokens.close()
        print("\n[interrupted]", file=sys.stderr)
    printer.finish()
    sys.stdout.write("\n")
    if last is not None and last.finish_reason == "length":
        where = " while still thinking, before any answer" if not "".join(content) and not calls else ""
        if _filled_the_context(model, last):
            print(f"[stopped at the end of the model's context ({model.config.max_position_embeddings} tokens)"
                  f"{where}; /reset starts a new conversation]", file=sys.stderr)
        else:
            print(f"[cut off by --max-tokens ({sampling.max_tokens}){where}; raise --max-tokens for more]",
                  file=sys.stderr)
    if last is not None and args.verbose:
        _print_stats(last.stats, sys.stderr)
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        reply["reasoning_content"] = "".join(reasoning)
    if calls:
        reply["tool_calls"] = [call.to_openai() for call in calls]
    return reply


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive chat; /reset clears the history, /quit or Ctrl-D leaves. Ctrl-C stops the
    current answer (or clears the line) and keeps the conversation."""
    model = _load(args)
    sampling = _sampling(model, args, chat=True)  # a bad flag is reported once, not at every turn
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, Any]] = []
    _line_editing()
    print("Type a message; /reset clears the conversation, /quit (or Ctrl-D) leaves.", file=sys.stderr)
    while True:
        try:
            line = input(">> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-C: the conversation is kept; /quit or Ctrl-D leaves)", file=sys.stderr)
            continue
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            history.clear()
            print("[conversation cleared]", file=sys.stderr)
            continue
        if not line.strip():
            continue
        message = {"role": "user", "content": line}
        reply = _chat_turn(model, system + history + [message], args, sampling)
        if reply is not None:
            history += [message, reply]


def cmd_serve(args: argparse.Namespace) -> int:
    """Delegate to the OpenAI-compatible server."""
    from lily import server

    argv = [args.model, "--host", args.host, "--port", str(args.port), "--backend", args.backend]
    for flag, value in (("--api-key", args.api_key), ("--cors-origin", args.cors_origin),
                        ("--max-context", args.max_context), ("--max-queue", args.max_queue),
                        ("--keepalive", args.keepalive), ("--precision", args.precision)):
        if value is not None:
            argv += [flag, str(value)]
    return server.main(argv)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """llama-bench style throughput table (or JSON)."""
    from lily import bench

    if args.host_only:
        if not args.full_size:
            raise ValueError("--host-only runs the full-size graph with synthetic weights: add --full-size")
        result = bench.host_cost(precision=args.precision or "bfloat16",
                                 rounds=10 if args.rounds is None else args.rounds)
        print(json.dumps(result, indent=2) if args.output == "json" else bench.format_host_cost(result))
        return 0
    if args.rounds is not None:
        raise ValueError("--rounds is the number of --host-only rounds; the throughput tests repeat -r times")
    profile_tokens = args.profile or max(args.p)  # --profile without N: the largest -p
    if args.dummy_weights:
        from lily import Model
        from lily.dummy import FULL_SIZE

        source = FULL_SIZE if args.full_size else args.model
        print(f"Loading {source} with dummy weights ...", file=sys.stderr, flush=True)
        model = Model.load(source, backend=args.backend, precision=args.precision, load_format="dummy",
                           max_context=bench.context_needed(args.p + [profile_tokens], args.n, args.d))
    elif args.full_size:
        raise ValueError("--full-size needs --dummy-weights (random weights of the full-size shapes) or --host-only")
    else:
        model = _load(args, bench.context_needed(args.p + [profile_tokens], args.n, args.d))
    if args.profile is not None:
        bench.require_profiling(model, profile_tokens)
    def report(row: "bench.BenchRow") -> None:
        print(f"  {row.test}: {row.avg_ts:.2f} ± {row.stddev_ts:.2f} t/s", file=sys.stderr, flush=True)

    rows = bench.run_bench(model, prompts=args.p, gens=args.n, depths=args.d, repetitions=args.r,
                           warmup=not args.no_warmup,
                           progress=lambda name: print(f"running {name} ...", file=sys.stderr, flush=True),
                           finished=report)
    info = bench.model_info(model)
    load = None
    if args.dummy_weights and any(args.p) and not args.no_expert_load:
        print("counting the expert load ...", file=sys.stderr, flush=True)
        load = bench.expert_load(model, next(p for p in args.p if p))
        info["expert_load"] = load.summary() if load is not None else None
    print(bench.format_json(rows, info) if args.output == "json" else bench.format_markdown(rows, info))
    if load is not None and args.output != "json":
        print(bench.format_expert_load(load))
    if args.profile is not None:
        times = bench.profile_prefill(model, profile_tokens)
        print(bench.format_profile(times, profile_tokens), file=sys.stderr if args.output == "json" else sys.stdout)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    """Download a repository into the Hugging Face cache and print its local path."""
    from lily import hub
    from lily.config import ModelArgs

    path = hub.resolve(args.repo, revision=args.revision)
    ModelArgs.from_file(path)  # a directory that is not a model is an error, not a path to print
    print(path)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The decode graph's dispatches, barrier stages and bytes per token (built, not run)."""
    import json

    from lily import hub
    from lily import plan as lily_plan
    from lily.backends.engine import switches_from_env
    from lily.config import ModelArgs

    model_args = lily_plan.full_size_args() if args.full_size else ModelArgs.from_file(hub.resolve(args.model))
    plan = lily_plan.plan_decode(model_args, context=args.context, precision=args.precision,
                                 switches=switches_from_env(os.environ))
    print(json.dumps(plan, indent=2) if args.json else lily_plan.format_plan(plan, lily_plan.PLAN_TARGETS))
    return 0


def _version() -> str:
    """``lily 0.1.0 (build 3f1d83f)``: the version and the commit the package was built from (``lily._build``)."""
    from lily import __version__, _build

    return f"lily {__version__} (build {_build.COMMIT})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="lily", description="Fast local inference of Qwen3.5/3.6-35B-A3B.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="continue a prompt (stream text to stdout, stats to stderr)")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text; '-' or omitted: read stdin")
    _add_model_flags(p)
    _add_sampling_flags(p, max_tokens_help=f"{DEFAULT_MAX_TOKENS}, {DEFAULT_CHAT_MAX_TOKENS} with --chat")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    p.add_argument("--system", default=None, help="system prompt (with --chat)")
    _add_thinking_flag(p, " (with --chat)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat; reasoning is shown apart from the answer")
    _add_model_flags(p)
    _add_sampling_flags(p, max_tokens_help=str(DEFAULT_CHAT_MAX_TOKENS))
    p.add_argument("--system", default=None, help="system prompt")
    _add_thinking_flag(p, "")
    p.add_argument("--preserve-thinking", action="store_true", help="keep earlier turns' reasoning in the prompt")
    p.add_argument("--verbose", "-v", action="store_true", help="print token counts and speeds after each answer")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None, help="require this API key (default: $LILY_API_KEY, else none); "
                   "/health stays open")
    p.add_argument("--cors-origin", default=None, help="allow browser requests from this origin")
    p.add_argument("--max-context", type=int, default=None, help="context limit below the model's own")
    p.add_argument("--max-queue", type=int, default=None,
                   help=f"requests allowed to wait (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--keepalive", type=float, default=None, help="seconds between SSE keep-alive comments (0: off)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="throughput benchmark (llama-bench conventions)")
    _add_model_flags(p)
    p.add_argument("-p", "--n-prompt", dest="p", type=_int_list, default=[512], help="prompt sizes (default 512)")
    p.add_argument("-n", "--n-gen", dest="n", type=_int_list, default=[128], help="generation sizes (default 128)")
    p.add_argument("-d", "--n-depth", dest="d", type=_int_list, default=[0], help="context depths (default 0)")
    p.add_argument("-r", "--repetitions", dest="r", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--no-warmup", action="store_true", help="time each test's first run too (by default each test "
                   "runs once untimed first, as llama-bench's do)")
    p.add_argument("-o", "--output", choices=("md", "json"), default="md", help="output format (default md)")
    p.add_argument("--json", dest="output", action="store_const", const="json", help="same as -o json")
    p.add_argument("--dummy-weights", action="store_true", help="random 4-bit weights of the model's shapes, no "
                   "weight file read (load_format='dummy'); prints the expert load over the first prefill size")
    p.add_argument("--no-expert-load", action="store_true", help="with --dummy-weights: skip the expert-load count "
                   "(a cpu backend over the same weights: about 21 GB of host memory at full size)")
    p.add_argument("--full-size", action="store_true", help="Qwen3.6-35B-A3B's shapes instead of --model's: with "
                   "--dummy-weights, or with --host-only (synthetic weights)")
    p.add_argument("--host-only", action="store_true", help="host cost per decode token with kernels stubbed out "
                   "(Linux test runtime): host_us_per_token, cpp_us_per_token")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="with --host-only: measure N rounds on one engine and report the quietest (default 10)")
    p.add_argument("--profile", nargs="?", type=int, const=0, default=None, metavar="N",
                   help="also the device time of each kernel of one prefill of N tokens (default: the largest -p; "
                   "cuda backend: every node run alone between CUDA events); on stderr with -o json")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("download", help="download a model repository (with progress bars)")
    p.add_argument("repo", help="Hugging Face repo id")
    p.add_argument("--revision", default=None, help="branch, tag or commit")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("plan", help="decode graph per token: dispatches, barrier stages, bytes (not run)")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="checkpoint whose config is planned (default lily:demo)")
    p.add_argument("--full-size", action="store_true", help="plan Qwen3.6-35B-A3B itself (no weights needed)")
    p.add_argument("--context", type=int, default=4096, help="tokens already in the cache (default 4096)")
    p.add_argument("--precision", choices=("bfloat16", "float32"), default="bfloat16", help="activations (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lily`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # silence the flush at exit
        return 1
    except Exception as exc:  # one clear line, never a traceback
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"lily: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
