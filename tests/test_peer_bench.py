"""scripts/peer_bench: the GGUF writer on a tiny shape read back by gguf-py (names, types and shapes as llama.cpp's
qwen35moe loader creates them, zero-mean Q4_0 blocks, metadata), the table on canned llama-bench and lily bench
JSON, sampled.py on a fake model, run.sh's build stage on a fake llama.cpp tree, the pruning of a llama.cpp tree, and
prepare.py's sdist download (pip as it is: build isolation on)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import gguf  # llama.cpp's gguf-py, in the test extras (pyproject.toml)
import numpy as np
import pytest

from fixtures import load_script, text_config

REPO = Path(__file__).resolve().parents[1]


def script(name: str):
    return load_script(f"scripts/peer_bench/{name}.py")


def expected_tensors(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (GGUF dims, innermost first, as llama.cpp's create_tensor lists them; type), from
    src/models/qwen35moe.cpp's load_arch_tensors at the bundled commit."""
    h, v, e = c["hidden_size"], c["vocab_size"], c["num_experts"]
    q4, f32 = "Q4_0", "F32"
    head, heads, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    hv, ff, shared = c["linear_num_value_heads"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    out = {"token_embd.weight": ((h, v), q4), "output_norm.weight": ((h,), f32), "output.weight": ((h, v), q4)}
    for i, kind in enumerate(c["layer_types"]):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": ((h,), f32), p + "post_attention_norm.weight": ((h,), f32)}
        if kind == "full_attention":
            out |= {p + "attn_q.weight": ((h, head * heads * 2), q4), p + "attn_k.weight": ((h, kv * head), q4),
                    p + "attn_v.weight": ((h, kv * head), q4), p + "attn_output.weight": ((head * heads, h), q4),
                    p + "attn_q_norm.weight": ((head,), f32), p + "attn_k_norm.weight": ((head,), f32)}
        else:
            out |= {p + "attn_qkv.weight": ((h, key_dim * 2 + value_dim), q4),
                    p + "attn_gate.weight": ((h, value_dim), q4),
                    p + "ssm_conv1d.weight": ((c["linear_conv_kernel_dim"], key_dim * 2 + value_dim), f32),
                    p + "ssm_dt.bias": ((hv,), f32), p + "ssm_a": ((hv,), f32),
                    p + "ssm_beta.weight": ((h, hv), q4), p + "ssm_alpha.weight": ((h, hv), q4),
                    p + "ssm_norm.weight": ((c["linear_value_head_dim"],), f32),
                    p + "ssm_out.weight": ((value_dim, h), q4)}
        out |= {p + "ffn_gate_inp.weight": ((h, e), f32), p + "ffn_down_exps.weight": ((ff, h, e), q4),
                p + "ffn_gate_exps.weight": ((h, ff, e), q4), p + "ffn_up_exps.weight": ((h, ff, e), q4),
                p + "ffn_gate_inp_shexp.weight": ((h,), f32), p + "ffn_gate_shexp.weight": ((h, shared), q4),
                p + "ffn_up_shexp.weight": ((h, shared), q4), p + "ffn_down_shexp.weight": ((shared, h), q4)}
    return out


def test_gguf_writer_on_a_tiny_shape(tmp_path):
    writer = script("write_gguf")
    config = {"model_type": "qwen3_5_moe_text", **text_config("gqa4")}  # attention every 3rd layer, 16 experts
    path = tmp_path / "tiny.gguf"
    writer.write(path, config, gguf, seed=3)
    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    a = "qwen35moe."
    assert fields["general.architecture"] == "qwen35moe" and fields["tokenizer.ggml.model"] == "no_vocab"
    assert {k: fields[a + k] for k in ("vocab_size", "embedding_length", "block_count", "attention.head_count",
                                       "attention.head_count_kv", "attention.key_length", "expert_count",
                                       "expert_used_count", "expert_feed_forward_length",
                                       "expert_shared_feed_forward_length", "ssm.conv_kernel", "ssm.inner_size",
                                       "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
                                       "full_attention_interval", "rope.dimension_count")} == {
        "vocab_size": 1152, "embedding_length": 192, "block_count": 6, "attention.head_count": 8,
        "attention.head_count_kv": 2, "attention.key_length": 64, "expert_count": 16, "expert_used_count": 4,
        "expert_feed_forward_length": 64, "expert_shared_feed_forward_length": 64, "ssm.conv_kernel": 4,
        "ssm.inner_size": 6 * 64, "ssm.state_size": 64, "ssm.time_step_rank": 6, "ssm.group_count": 2,
        "full_attention_interval": 3, "rope.dimension_count": 32}
    assert fields[a + "rope.dimension_sections"] == [6, 6, 4, 0]

    expected = expected_tensors(config)
    got = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors}
    assert got == expected
    arch_names = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35MOE]}
    for name in got:  # every tensor is one gguf-py knows for this architecture
        base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        assert base.replace(f"blk.{base.split('.')[1]}.", "blk.{bid}.") in arch_names if name.startswith("blk.") \
            else base in arch_names, name

    tensors = {t.name: t for t in reader.tensors}
    experts = tensors["blk.0.ffn_gate_exps.weight"]
    blocks = np.frombuffer(experts.data.tobytes(), writer._BLOCK)
    nibbles = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4]).reshape(-1)
    assert nibbles.min() >= 1 and nibbles.max() <= 15  # q - 8 in -7..7: symmetric
    assert 0.4 < (blocks["d"] > 0).mean() < 0.6  # signed scales
    values = gguf.dequantize(experts.data, experts.tensor_type)
    assert abs(values.mean()) < 0.02 * values.std()
    assert values.std() == pytest.approx(1 / math.sqrt(192), rel=0.1)  # keeps its input's RMS
    ssm_a = gguf.dequantize(tensors["blk.0.ssm_a"].data, tensors["blk.0.ssm_a"].tensor_type)
    assert (ssm_a <= -1).all() and (ssm_a >= -16).all()  # -exp(A_log), A in [1, 16]
    assert (np.asarray(tensors["output_norm.weight"].data) == 1).all()


def canned(rows: list[tuple[int, int, int, list[float]]], test_time: str | None = None) -> list[dict]:
    return [{"n_prompt": p, "n_gen": n, "n_depth": d, "samples_ts": s, "avg_ts": sum(s) / len(s)}
            | ({"test_time": test_time} if test_time else {}) for p, n, d, s in rows]


def test_table_on_canned_runs(tmp_path, capsys):
    table = script("table")
    peer = canned([(512, 0, 0, [5000, 5100, 4900, 5050, 4950]), (0, 128, 0, [240, 250, 245, 260, 230]),
                   (0, 128, 4096, [231, 250, 240, 235, 245])])
    lily = canned([(512, 0, 0, [10000, 10200, 9800, 10100, 9900]), (0, 128, 4096, [500, 480, 520, 510, 490])])
    (tmp_path / "llama-bench.json").write_text(json.dumps(peer))
    (tmp_path / "lily-bench.json").write_text(json.dumps(lily))
    (tmp_path / "plan.json").write_text(json.dumps({"0": 1.80e9, "4096": 1.88e9}))
    (tmp_path / "bandwidth.json").write_text(json.dumps({"bytes_per_second": 4.2e12, "how": "canned"}))
    assert table.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:5]}
    assert rows["pp512"] == ["5,000.0", "", "", "10,000.0", "", "", "2.00x"]  # medians; no bandwidth for prefill
    assert rows["tg128"] == ["245.0", f"{245 * 1.80:.0f}", f"{245 * 1.80e9 / 4.2e12:.1%}", "-", "-", "-", "-"]
    # decode at depth 4096: 240 and 500 tok/s at 1.88 GB per token, 4.2 TB/s
    assert rows["tg128 @ d4096"] == ["240.0", "451", "10.7%", "500.0", "940", "22.4%", "2.08x"]
    assert "4.20 TB/s" in lines[-1] and "d4096 1.880 GB" in lines[-1]
    sampled = {"tokens": 128, "rounds": {"greedy": [300.0] * 3, "sampled": [270.0] * 3},
               "median": {"greedy": 300.0, "sampled": 270.0}, "sampled_over_greedy": 0.9}
    (tmp_path / "sampled.json").write_text(json.dumps(sampled))
    assert table.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "sampled (T 0.7, top-p 0.9, top-k 50) / greedy decode: 0.900 (270.0 / 300.0 tok/s, tg128, medians of 3 rounds "
        "in one process)")
    (tmp_path / "bandwidth.json").unlink()
    assert table.main([str(tmp_path)]) == 1


@pytest.mark.parametrize("lily_time,refused", [("2026-12-05T22:40:00Z", False), ("2026-12-05T23:10:01Z", True),
                                               ("2026-12-05T19:00:00Z", True), (None, False)])
def test_table_refuses_sides_measured_apart(tmp_path, capsys, lily_time, refused):
    """llama.cpp's rows from 21:53 to 22:10 and Lily's at `lily_time`: more than an hour between the two spans (an
    earlier run's file left in the folder) is refused with both times named; undated rows are said to be."""
    table = script("table")
    peer = canned([(512, 0, 0, [5000.0])], "2026-12-05T21:53:11Z") + canned([(0, 128, 0, [250.0])],
                                                                               "2026-12-05T22:10:00Z")
    (tmp_path / "llama-bench.json").write_text(json.dumps(peer))
    (tmp_path / "lily-bench.json").write_text(json.dumps(canned([(0, 128, 0, [500.0])], lily_time)))
    (tmp_path / "bandwidth.json").write_text(json.dumps({"bytes_per_second": 4.2e12}))
    assert table.main([str(tmp_path)]) == (1 if refused else 0)
    captured = capsys.readouterr()
    if refused:
        assert "not one run" in captured.err and "llama.cpp 2026-12-05 21:53-22:10 UTC" in captured.err
        assert captured.out == ""
    else:
        lily_when = f"Lily 2026-12-05 {lily_time[11:16]}-{lily_time[11:16]} UTC" if lily_time else "Lily not dated"
        assert f"measured: llama.cpp 2026-12-05 21:53-22:10 UTC, {lily_when}" in captured.out.splitlines()


class FakeModel:
    """prefill() -> a session whose decode() logs its options and yields `made` tokens (max_tokens by default)."""

    def __init__(self, made: int | None = None):
        self.made, self.calls = made, []

    def prefill(self, prompt, use_cache=True):
        assert use_cache is False and prompt == [1, 2, 3]
        model = self

        class Session:
            def decode(self, max_tokens, stop_token_ids=None, **options):
                model.calls.append({"max_tokens": max_tokens, "stop_token_ids": stop_token_ids, **options})
                yield from range(max_tokens if model.made is None else model.made)

        return Session()


def test_sampled_times_both_modes_round_by_round_after_a_warm_up():
    sampled = script("sampled")
    # seconds per decode, in call order: (greedy, sampled) per round; round 0 is the warm-up
    durations = iter([9.0, 9.0, 2.0, 2.5, 2.0, 5.0, 4.0, 2.5])
    now = [0.0]

    def clock():  # called at each decode's start and end: the end advances by that decode's duration
        clock.calls += 1
        if clock.calls % 2 == 0:
            now[0] += next(durations)
        return now[0]

    clock.calls = 0
    model = FakeModel()
    result = sampled.measure(model, [1, 2, 3], rounds=3, tokens=128, clock=clock)
    assert result["rounds"] == {"greedy": [64.0, 64.0, 32.0], "sampled": [51.2, 25.6, 51.2]}
    assert result["median"] == {"greedy": 64.0, "sampled": 51.2}
    assert result["sampled_over_greedy"] == 0.8
    assert model.calls[0] == {"max_tokens": 128, "stop_token_ids": (), "temperature": 0.0, "repetition_penalty": 1.0}
    assert model.calls[1] == {"max_tokens": 128, "stop_token_ids": (), "temperature": 0.7, "top_p": 0.9,
                              "top_k": 50, "seed": 1, "repetition_penalty": 1.0}
    assert len(model.calls) == 8


def test_sampled_refuses_a_decode_that_stopped_short():
    with pytest.raises(RuntimeError, match="greedy decode made 5 tokens, not 128"):
        script("sampled").measure(FakeModel(made=5), [1, 2, 3], rounds=1, tokens=128)


def test_prune_keeps_what_a_cuda_llama_bench_build_needs(tmp_path):
    prepare = script("prepare")
    source, dest = tmp_path / "src", tmp_path / "dest"
    for path in ("CMakeLists.txt", "ggml/src/ggml.c", "ggml/src/ggml-cuda/mmq.cu", "ggml/src/ggml-cpu/ops.cpp",
                 "ggml/src/ggml-metal/ggml-metal.metal", "ggml/src/ggml-vulkan/x.cpp", "tools/CMakeLists.txt",
                 "tools/llama-bench/llama-bench.cpp", "tools/server/public/index.html", "src/llama-arch.cpp",
                 "gguf-py/gguf/gguf_writer.py", "gguf-py/tests/t.py", "models/ggml-vocab-qwen35.gguf",
                 "docs/build.md", "vendor/stb/stb_image.h", "common/common.cpp"):
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text("x")
    dest.mkdir()
    prepare.prune(source, dest)
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == ["CMakeLists.txt", "common/common.cpp", "ggml/src/ggml-cpu/ops.cpp", "ggml/src/ggml-cuda/mmq.cu",
                    "ggml/src/ggml.c", "gguf-py/gguf/gguf_writer.py", "src/llama-arch.cpp", "tools/CMakeLists.txt",
                    "tools/llama-bench/llama-bench.cpp", "vendor/stb/stb_image.h"]
    assert (dest / "tools" / "CMakeLists.txt").read_text().strip().endswith("add_subdirectory(llama-bench)")


def fake_llama_tree(repo, body: str) -> None:
    """run.sh and a llama.cpp tarball in a repository layout: a CMake project whose llama-bench target is a tiny C
    program (the build stage's CUDA options are defined and ignored)."""
    (repo / "scripts" / "peer_bench").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "peer_bench" / "run.sh", repo / "scripts" / "peer_bench" / "run.sh")
    source = repo / "src" / "llama.cpp"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(fake C)\nset(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)"
        "\nadd_executable(llama-bench main.c)\n")
    (source / "main.c").write_text(body)
    (repo / ".dev" / "peer").mkdir(parents=True)
    with tarfile.open(repo / ".dev" / "peer" / "llama.cpp.tar.gz", "w:gz") as tar:
        tar.add(source, arcname="llama.cpp")
    (repo / ".dev" / "peer" / "llama.cpp.commit").write_text("fake@0\n")


def test_build_stage_waits_for_a_running_build_and_resumes_one_cut_short(tmp_path):
    """run.sh's build stage: built once from the tarball; a second caller waits while the build lock is held (a
    call made while an earlier call's build still runs) instead of deleting the tree under it; a tree whose build
    did not finish is built on, not extracted again."""
    repo, work = tmp_path / "repo", tmp_path / "work"
    fake_llama_tree(repo, "int main(void) { return 0; }\n")
    env = {**os.environ, "PEER_WORK": str(work), "OUT": str(tmp_path / "out"), "JOBS": "2"}
    stage = ["bash", str(repo / "scripts" / "peer_bench" / "run.sh"), "build"]
    subprocess.run(stage, env=env, check=True, capture_output=True, timeout=300)
    bench = work / "llama.cpp" / "build" / "bin" / "llama-bench"
    assert bench.is_file() and (tmp_path / "out" / "llama.cpp.commit").read_text() == "fake@0\n"

    bench.unlink()  # a build cut short: no llama-bench, the tree and its build folder still there
    (work / "llama.cpp" / "kept").write_text("not extracted again")
    with open(work / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = subprocess.Popen(stage, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=2)
        assert not bench.exists()
        fcntl.flock(lock, fcntl.LOCK_UN)
        assert waiting.wait(timeout=300) == 0
    assert bench.is_file() and (work / "llama.cpp" / "kept").is_file()


ISOLATED_ONLY_BACKEND = '''
import importlib.util
from pathlib import Path


def _fail_unless_isolated():
    # llama-cpp-python builds with scikit-build-core, which pip installs only into the isolated build environment:
    # this backend likewise works only there, where the test's own packages (pytest) are not importable.
    if importlib.util.find_spec("pytest") is not None:
        raise RuntimeError("metadata prepared without build isolation")


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _fail_unless_isolated()
    info = Path(metadata_directory) / "llama_cpp_python-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\\nName: llama_cpp_python\\nVersion: {version}\\n")
    return info.name
'''


def test_fetch_sdist_lets_pip_prepare_the_sdist_in_build_isolation(tmp_path, monkeypatch):
    """pip downloads the source distribution from a local index whose build backend works only in the isolated
    environment pip makes; a download without build isolation (the bug of issue 23) fails here."""
    prepare = script("prepare")
    package, version, _ = prepare.SDIST
    project = tmp_path / "project" / f"llama_cpp_python-{version}"
    (project / "vendor" / "llama.cpp" / "src").mkdir(parents=True)
    (project / "vendor" / "llama.cpp" / "src" / "llama-arch.cpp").write_text("// LLM_ARCH_QWEN35MOE qwen35moe\n")
    (project / "backend.py").write_text(ISOLATED_ONLY_BACKEND.replace("{version}", version))
    (project / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                            'backend-path = ["."]\n')
    (project / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    index = tmp_path / "index"
    index.mkdir()
    with tarfile.open(index / f"llama_cpp_python-{version}.tar.gz", "w:gz") as tar:
        tar.add(project, arcname=project.name)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    work = tmp_path / "work"
    work.mkdir()
    tree = prepare.fetch_sdist(work)
    assert "qwen35moe" in (tree / "src" / "llama-arch.cpp").read_text()
