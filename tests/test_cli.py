"""The ``lily`` command: output streams, errors as one line, bench output, delegation."""

from __future__ import annotations

import calendar
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lily
from lily import _build, cli
from test_api import (  # noqa: F401 (chat_model_dir and model are fixtures)
    ScriptedBackend,
    chat_model_dir,
    model,
    with_backend,
)


def run_cli(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_text_to_stdout_and_stats_to_stderr(model, chat_model_dir, capsys):
    code, out, err = run_cli(["generate", "the cat", "--model", str(chat_model_dir), "--backend", "reference",
                              "--max-tokens", "5", "--temp", "0"], capsys)
    assert code == 0
    expected = model.generate("the cat", max_tokens=5, temperature=0, use_cache=False)
    assert out == expected.text + "\n"
    assert f"Prompt: {len(model.tokenizer.encode('the cat'))} tokens" in err and "Generation: " in err and "Peak memory: " in err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "x", "--model", "/nonexistent/model-dir"], "/nonexistent/model-dir"),
    (["generate", "x", "--top-p", "2"], "top_p"),
    (["bench", "-r", "0"], "-r"),
    (["bench", "-p", "8", "--profile", "512"], "--profile needs the cuda or cpu backend"),
])
def test_errors_are_one_line_without_traceback(argv, needle, chat_model_dir, capsys):
    if "--model" not in argv:
        argv = argv + ["--model", str(chat_model_dir), "--backend", "reference"]
    code, out, err = run_cli(argv, capsys)
    lines = [line for line in err.splitlines() if not line.startswith("Loading ")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("lily: error:") and needle in lines[0]
    assert "Traceback" not in err


def test_entry_point_reports_errors_in_a_subprocess(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lily.cli", "generate", "x", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("lily: error:")


@pytest.mark.parametrize("warmup", [True, False])
def test_bench_warms_each_test_up_untimed(chat_model_dir, capsys, monkeypatch, warmup):
    """Each test's first run is a warm-up left out of its samples (llama-bench's rule), unless --no-warmup: the
    fake timers return 100 s for a test's first run, then 1 s, 2 s, and each row keeps exactly its repetitions."""
    from lily import bench
    calls = []
    runs = 3 if warmup else 2  # per test: -r 2, and the warm-up

    def timer(kind):
        def run(model, base, *args, **kwargs):
            calls.append((kind, len(base)))
            return float((len(calls) - 1) % runs) or 100.0
        return run

    monkeypatch.setattr(bench, "_time_prefill", timer("pp"))
    monkeypatch.setattr(bench, "_time_generate", timer("tg"))
    flags = [] if warmup else ["--no-warmup"]
    code, out, _ = run_cli(["bench", "--model", str(chat_model_dir), "--backend", "reference", "-p", "6", "-n", "3",
                            "-d", "0,5", "-r", "2", "-o", "json", *flags], capsys)
    assert code == 0
    rows = json.loads(out)
    assert [kind for kind, _ in calls] == ["pp"] * runs + ["tg"] * runs + ["pp"] * runs + ["tg"] * runs
    assert [depth for _, depth in calls] == [0] * 2 * runs + [5] * 2 * runs  # each test forks its depth's session
    for row in rows:
        assert row["samples_ns"] == ([1_000_000_000, 2_000_000_000] if warmup else [100_000_000_000, 1_000_000_000])


def test_bench_json_and_markdown(chat_model_dir, capsys):
    base = ["bench", "--model", str(chat_model_dir), "--backend", "reference", "-p", "6", "-n", "3",
            "-d", "0,5", "-r", "2"]
    started = time.time()
    code, out, err = run_cli(base + ["-o", "json"], capsys)
    assert code == 0
    rows = json.loads(out)
    # When each test started, in llama-bench's test_time format (UTC, whole seconds), in run order.
    started_at = [calendar.timegm(time.strptime(r["test_time"], "%Y-%m-%dT%H:%M:%SZ")) for r in rows]
    assert int(started) <= started_at[0] and started_at == sorted(started_at) and started_at[-1] <= time.time()
    assert [r["test"] for r in rows] == ["pp6", "tg3", "pp6 @ d5", "tg3 @ d5"]
    # Each result is shown as its test finishes (a full-size run takes minutes), in the table's numbers.
    shown = re.findall(r"^  (.+): ([\d.]+) ± [\d.]+ t/s$", err, re.M)
    assert [(test, float(ts)) for test, ts in shown] == [(r["test"], pytest.approx(r["avg_ts"], abs=0.006))
                                                          for r in rows]
    for row in rows:
        assert len(row["samples_ts"]) == 2 and len(row["samples_ns"]) == 2
        n = row["n_prompt"] or row["n_gen"]
        assert row["samples_ts"] == pytest.approx([n / (ns / 1e9) for ns in row["samples_ns"]], rel=1e-6)
        assert row["avg_ts"] == pytest.approx(sum(row["samples_ts"]) / 2)
        # The reference backend holds no GPU memory: its peak is the process's, as the host figure.
        assert row["peak_memory"] > 0 and row["model_n_params"] > 0 and row["host_memory"] == row["peak_memory"]
    code, out, _ = run_cli(base + ["-r", "1"], capsys)
    lines = out.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["model", "size", "params", "backend", "test",
                                                               "t/s", "peak GB", "host GB"]
    assert [line.split("|")[5].strip() for line in lines[2:6]] == ["pp6", "tg3", "pp6 @ d5", "tg3 @ d5"]
    assert all("±" in line for line in lines[2:6])
    # llama-bench's layout: every row the same width, columns padded to at least its widths, the
    # numbers right-aligned, a model description rather than the folder name, a build line.
    assert len({len(line) for line in lines[:6]}) == 1 and lines[1].startswith("| " + "-" * 30 + " | ")
    assert [len(c) for c in lines[0].split("|")[1:-1]][:6] == [32, 12, 12, 12, 17, 22]
    cells = lines[2].split("|")[1:-1]
    assert re.fullmatch(r"qwen3_5_moe \d+[KMB]\.A\d+[KMB] (\d-bit|BF16|F16|F32)", cells[0].strip())
    assert cells[0].startswith(" q") and cells[1].endswith(" GiB ") and cells[1].startswith("  ")
    assert chat_model_dir.name not in lines[2]
    build = next(line for line in lines if line.startswith("build: "))
    assert build == f"build: {_build.COMMIT} (lily {lily.__version__})"  # recorded by the build (test_build.py)


def test_version_names_the_build_commit(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"lily {lily.__version__} (build {_build.COMMIT})\n"
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?|unknown", _build.COMMIT)


def test_serve_delegates_with_its_flags(monkeypatch):
    import lily.server

    seen = {}
    monkeypatch.setattr(lily.server, "main", lambda argv: seen.__setitem__("argv", argv) or 0)
    assert cli.main(["serve", "--port", "9000", "--api-key", "k", "--cors-origin", "http://x",
                     "--max-context", "128"]) == 0
    assert seen["argv"] == ["lily:demo", "--host", "127.0.0.1", "--port", "9000", "--backend", "auto",
                            "--api-key", "k", "--cors-origin", "http://x", "--max-context", "128"]
    assert cli.main(["serve", "--backend", "metal", "--precision", "float32", "--max-queue", "3",
                     "--keepalive", "0"]) == 0
    assert seen["argv"] == ["lily:demo", "--host", "127.0.0.1", "--port", "8080", "--backend", "metal",
                            "--max-queue", "3", "--keepalive", "0.0", "--precision", "float32"]


@pytest.mark.metal
def test_generate_on_the_metal_backend_matches_the_reference(capsys):
    argv = ["generate", "ROMEO:", "--max-tokens", "4", "--temp", "0"]
    code, reference_out, _ = run_cli(argv + ["--backend", "reference"], capsys)
    assert code == 0 and reference_out.strip()
    code, metal_out, _ = run_cli(argv + ["--backend", "metal", "--precision", "float32"], capsys)
    assert code == 0 and metal_out == reference_out


def test_download_prints_the_local_path(monkeypatch, capsys, tmp_path):
    import lily.hub

    calls = []
    shutil.copy(lily.hub.resolve("lily:demo") / "config.json", tmp_path / "config.json")
    monkeypatch.setattr(lily.hub, "resolve", lambda repo, revision=None: calls.append((repo, revision)) or tmp_path)
    code, out, _ = run_cli(["download", "org/name", "--revision", "abc"], capsys)
    assert code == 0 and out.strip() == str(tmp_path) and calls == [("org/name", "abc")]


def test_download_refuses_a_directory_that_is_not_a_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "etc").mkdir()
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    code, out, err = run_cli(["download", "../etc"], capsys)
    assert code == 1 and out == ""
    assert err.startswith("lily: error: ") and "config.json" in err and len(err.strip().splitlines()) == 1

    def offline(repo, revision=None):
        raise lily.hub.HubError(f"{repo} is not cached and HF_HUB_OFFLINE=1")

    monkeypatch.setattr(lily.hub, "resolve", offline)
    code, _, err = run_cli(["download", "org/name"], capsys)
    assert code == 1 and err.strip() == "lily: error: org/name is not cached and HF_HUB_OFFLINE=1"


def test_chat_shows_thinking_apart_from_the_answer(model, monkeypatch, capsys):
    tok = model.tokenizer
    reply = "hmm</think>\n\nfour"
    messages = [{"role": "user", "content": "2+2?"}]
    script = tok.encode(reply) + [tok.token_to_id("<|im_end|>")]
    scripted = with_backend(model, ScriptedBackend(model.config.vocab_size, script, len(model.encode(messages))))
    monkeypatch.setattr(lily.Model, "load", classmethod(lambda cls, *a, **k: scripted))
    monkeypatch.setattr(sys, "stdin", io.StringIO("2+2?\n/quit\n"))
    code, out, _ = run_cli(["chat", "--max-tokens", "50"], capsys)
    assert code == 0
    assert "[thinking] hmm\n[answer] four" in out


def test_thinking_flags_default_to_the_template():
    parser = cli.build_parser()
    for command in (["chat"], ["generate", "x", "--chat"]):
        assert [parser.parse_args(command + flag).thinking for flag in ([], ["--thinking"], ["--no-thinking"])] == [
            None, True, False]


def test_generate_says_when_the_context_ended_it(model, monkeypatch, capsys):
    small = lily.Model(ScriptedBackend(model.config.vocab_size, [], 0),
                       dataclasses.replace(model.config, max_position_embeddings=16), model.tokenizer,
                       backend_name="scripted", fingerprint="small")
    monkeypatch.setattr(lily.Model, "load", classmethod(lambda cls, *a, **k: small))
    prompt = "b" * 10  # 10 tokens: letters that take part in no merge
    for max_tokens, note in ((4, False), (16, True)):
        code, _, err = run_cli(["generate", prompt, "--max-tokens", str(max_tokens), "--temp", "0"], capsys)
        assert code == 0
        assert ("[stopped at the end of the model's context (16 tokens)]" in err) == note, err
        assert f"Generation: {min(max_tokens, 6)} tokens" in err


def test_chat_says_when_the_context_ended_the_answer(model, monkeypatch, capsys):
    small = lily.Model(ScriptedBackend(model.config.vocab_size, [], 0),
                       dataclasses.replace(model.config, max_position_embeddings=32), model.tokenizer,
                       backend_name="scripted", fingerprint="small")
    monkeypatch.setattr(lily.Model, "load", classmethod(lambda cls, *a, **k: small))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/quit\n"))
    code, _, err = run_cli(["chat", "--temp", "0", "--no-thinking"], capsys)
    assert code == 0 and "cut off by --max-tokens" not in err
    assert "[stopped at the end of the model's context (32 tokens); /reset starts a new conversation]" in err


def test_chat_reports_an_impossible_max_tokens_once(chat_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhi again\n/quit\n"))
    code, out, err = run_cli(["chat", "--model", str(chat_model_dir), "--backend", "reference",
                              "--max-tokens", "10000000000"], capsys)
    lines = [line for line in err.splitlines() if not line.startswith("Loading ")]
    assert code == 1 and out == "" and lines == [
        "lily: error: Model.sampling_params(): max_tokens must be at most the model's context of 4096 tokens (prompt "
        "and answer share it); got 10000000000"]


def test_generate_defaults_to_the_demo_model(capsys):
    """No --model: lily:demo; no sampling flags: its generation_config.json (temperature, top-k/p, penalty)."""
    code, out, err = run_cli(["generate", "ROMEO:", "--max-tokens", "12", "--seed", "1", "--backend", "reference"],
                             capsys)
    assert code == 0 and "Loading lily:demo" in err
    demo = lily.Model.load("lily:demo", backend="reference")
    config = json.loads((demo.path / "generation_config.json").read_text())
    defaults = {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in config}
    assert defaults.get("temperature", 1.0) not in (0.0, 1.0), "the demo's defaults must change the draw"
    expected = demo.generate("ROMEO:", max_tokens=12, seed=1, **defaults)
    plain = demo.generate("ROMEO:", max_tokens=12, seed=1, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                          repetition_penalty=1.0)
    assert expected.text.strip() and expected.text != plain.text
    assert out == expected.text + "\n"


@pytest.mark.parametrize("argv, needle", [
    (["--model", "/nonexistent"], "/nonexistent"),
    (["--max-context", "10000"], "--max-context"),
    (["--port", "99999"], "--port"),
    (["--port", "{busy}"], "cannot listen on 127.0.0.1:{busy}"),
])
def test_serve_startup_errors_are_one_line(argv, needle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        argv = [a.replace("{busy}", port) for a in argv]
        proc = subprocess.run([sys.executable, "-m", "lily.cli", "serve", "--backend", "reference", *argv],
                              capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("lily serve: error: ") and needle.replace("{busy}", port) in lines[0]


def test_serve_help_names_the_key_variable_and_the_queue_default(capsys):
    for argv in (["serve", "--help"], None):
        with pytest.raises(SystemExit):
            if argv is None:
                import lily.server

                lily.server.main(["--help"])
            else:
                cli.main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert "LILY_API_KEY" in out and "(default 16)" in out


def test_generate_gives_the_same_text_as_python_with_the_same_seed(capsys):
    code, out, _ = run_cli(["generate", "ROMEO:", "--max-tokens", "12", "--seed", "3", "--backend", "reference"],
                           capsys)
    demo = lily.Model.load("lily:demo", backend="reference")
    assert demo.sampling_defaults  # the demo's generation_config sets some: the test compares something
    assert code == 0 and out == demo.generate("ROMEO:", max_tokens=12, seed=3).text + "\n"


def test_chat_reports_an_over_context_turn_and_goes_on(model, chat_model_dir, monkeypatch, capsys):
    too_long = "b" * (model.config.max_position_embeddings + 10)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{too_long}\n/reset\nhi\n/quit\n"))
    code, out, err = run_cli(["chat", "--model", str(chat_model_dir), "--backend", "reference",
                              "--max-tokens", "3", "--temp", "0"], capsys)
    assert code == 0
    assert "lily: error: prompt too long" in err and "the message was not added" in err
    assert "[conversation cleared]" in err
    # The next turn is answered as a fresh conversation would be, with a note if it was cut off.
    expected = model.chat([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert expected.finish_reason == "length"
    assert ("while still thinking" in err) == (not expected.content and not expected.tool_calls)
    assert "cut off by --max-tokens (3)" in err


def _default_signals() -> None:
    """In the terminal's child before exec: Ctrl-C and job-control signals as in a fresh shell, none blocked, so the
    test does not depend on what the test process's other threads and tests did to its own signal state."""
    for number in (signal.SIGINT, signal.SIGTTIN, signal.SIGTTOU, signal.SIGTSTP):
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def test_chat_in_a_terminal_keeps_the_conversation_on_ctrl_c_and_has_history(chat_model_dir, tmp_path):
    """Through a pseudo-terminal: Ctrl-C at the prompt and during a prefill keep the conversation,
    the up arrow recalls the last message, and a 5,000-byte paste arrives whole."""
    import pexpect  # a terminal driver; a missing one is a failure, not a skip
    log = tmp_path / "turns.jsonl"
    driver = Path(__file__).parent / "chat_pty_driver.py"
    child = pexpect.spawn(sys.executable, [str(driver), str(chat_model_dir), str(log)], encoding="utf-8",
                          timeout=60, env={**os.environ, "TERM": "xterm"}, dimensions=(40, 200),
                          preexec_fn=_default_signals)
    try:
        child.expect_exact(">> ")
        child.send("hello\r")
        child.expect_exact(">> ")
        time.sleep(0.5)  # readline has the terminal: keys typed now are read by it, as a person's would be
        child.send("half typed")
        child.expect_exact("half typed")  # echoed: readline has read the keys and waits for the next one
        child.sendintr()  # Ctrl-C at the prompt
        child.expect_exact("the conversation is kept")
        child.expect_exact(">> ")
        child.send("slow message\r")
        wait_for = time.monotonic() + 30
        while not log.exists() or len(log.read_text().splitlines()) < 2:
            assert time.monotonic() < wait_for
            time.sleep(0.05)
        time.sleep(0.3)
        child.sendintr()  # Ctrl-C during the prefill
        child.expect_exact("[interrupted before the answer")
        child.expect_exact(">> ")
        child.send("again\r")
        child.expect_exact(">> ")
        child.send("\x1b[A\r")  # up arrow: "again" once more
        child.expect_exact(">> ")
        paste = "bcdfgjkm" * 625  # 5,000 bytes: more than a tty's 4,095-byte line
        child.send(paste + "\r")
        child.expect_exact(">> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    turns = [json.loads(line) for line in log.read_text().splitlines()]
    users = [[m["content"] for m in turn if m["role"] == "user"] for turn in turns]
    assert users[0] == ["hello"] and users[1] == ["hello", "slow message"]
    assert users[2] == ["hello", "again"]  # the interrupted message was dropped, "hello" kept
    assert users[3] == ["hello", "again", "again"]  # recalled with the arrow key
    assert users[4][-1] == paste
    assert [m["role"] for m in turns[3]] == ["user", "assistant", "user", "assistant", "user"]
