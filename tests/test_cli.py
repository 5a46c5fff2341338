"""The ``lily`` command: output streams, errors as one line, bench output, delegation."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import lily
from lily import cli
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


def test_bench_json_and_markdown(chat_model_dir, capsys):
    base = ["bench", "--model", str(chat_model_dir), "--backend", "reference", "-p", "6", "-n", "3",
            "-d", "0,5", "-r", "2"]
    code, out, _ = run_cli(base + ["-o", "json"], capsys)
    assert code == 0
    rows = json.loads(out)
    assert [r["test"] for r in rows] == ["pp6", "tg3", "pp6 @ d5", "tg3 @ d5"]
    for row in rows:
        assert len(row["samples_ts"]) == 2 and len(row["samples_ns"]) == 2
        n = row["n_prompt"] or row["n_gen"]
        assert row["samples_ts"] == pytest.approx([n / (ns / 1e9) for ns in row["samples_ns"]], rel=1e-6)
        assert row["avg_ts"] == pytest.approx(sum(row["samples_ts"]) / 2)
        assert row["peak_memory"] > 0 and row["model_n_params"] > 0
    code, out, _ = run_cli(base + ["-r", "1"], capsys)
    lines = out.splitlines()
    assert lines[0].split("|")[1:-1] == [f" {c} " for c in ("model", "size", "params", "backend", "test",
                                                              "t/s", "peak GB")]
    assert [line.split("|")[5].strip() for line in lines[2:6]] == ["pp6", "tg3", "pp6 @ d5", "tg3 @ d5"]
    assert all("±" in line for line in lines[2:6])


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


def test_generate_on_the_metal_backend_matches_the_reference(capsys):
    argv = ["generate", "ROMEO:", "--max-tokens", "4", "--temp", "0"]
    code, reference_out, _ = run_cli(argv + ["--backend", "reference"], capsys)
    assert code == 0 and reference_out.strip()
    code, metal_out, _ = run_cli(argv + ["--backend", "metal", "--precision", "float32"], capsys)
    assert code == 0 and metal_out == reference_out


def test_download_prints_the_local_path(monkeypatch, capsys, tmp_path):
    import lily.hub

    calls = []
    monkeypatch.setattr(lily.hub, "resolve", lambda repo, revision=None: calls.append((repo, revision)) or tmp_path)
    code, out, _ = run_cli(["download", "org/name", "--revision", "abc"], capsys)
    assert code == 0 and out.strip() == str(tmp_path) and calls == [("org/name", "abc")]

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
    without_defaults = demo.generate("ROMEO:", max_tokens=12, seed=1)
    assert expected.text.strip() and expected.text != without_defaults.text
    assert out == expected.text + "\n"
