"""lily.hub.resolve without the network: local paths, lily:demo, a fake HF cache, a patched download."""

from __future__ import annotations

import fnmatch
import importlib.resources
from pathlib import Path

import httpx
import huggingface_hub
import pytest
from huggingface_hub.errors import RepositoryNotFoundError

from lily import hub
from lily.hub import HubError, resolve

_SHA = "0123456789abcdef0123456789abcdef01234567"


def _fake_cache(hf_home: Path, repo_id: str, files: dict[str, str], sha: str = _SHA) -> Path:
    """A repo laid out in the hub cache as huggingface_hub writes it (blobs + snapshot symlinks)."""
    repo_dir = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / sha
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    snapshot.mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(sha)
    for i, (name, content) in enumerate(files.items()):
        blob = repo_dir / "blobs" / f"{i:040x}"
        blob.write_text(content)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


@pytest.fixture
def offline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_local_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve(tmp_path) == tmp_path
    assert resolve(str(tmp_path)) == tmp_path


def test_local_file_and_missing_path_are_rejected(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(HubError, match="expected a checkpoint directory"):
        resolve(f)
    with pytest.raises(HubError, match="neither an existing directory nor"):
        resolve(str(tmp_path / "no" / "such" / "dir"))


def test_lily_demo_resolves_inside_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "lily"
    (package / "demo").mkdir(parents=True)
    (package / "demo" / "config.json").write_text("{}")
    seen = []

    def files(name: str):
        seen.append(name)
        return package

    monkeypatch.setattr(importlib.resources, "files", files)
    assert resolve("lily:demo") == package / "demo"
    assert seen == ["lily"]
    with pytest.raises(HubError, match="lily:nope"):
        resolve("lily:nope")
    (package / "demo" / "config.json").unlink()
    with pytest.raises(HubError, match="not included"):
        resolve("lily:demo")


def test_offline_uses_the_cache(offline_home: Path) -> None:
    snapshot = _fake_cache(offline_home, "org/tiny", {"config.json": "{}", "model.safetensors": "x"})
    assert resolve("org/tiny") == snapshot
    assert resolve("org/tiny", revision=_SHA) == snapshot
    assert (resolve("org/tiny") / "config.json").read_text() == "{}"


def test_offline_and_not_cached_names_repo_and_fix(offline_home: Path) -> None:
    _fake_cache(offline_home, "org/tiny", {"config.json": "{}"})
    with pytest.raises(HubError) as info:
        resolve("org/other")
    message = str(info.value)
    assert "org/other" in message and "HF_HUB_OFFLINE" in message and "hf download org/other" in message
    assert str(offline_home / "hub") in message
    with pytest.raises(HubError, match="org/tiny@v9.*--revision v9"):
        resolve("org/tiny", revision="v9")


def test_offline_snapshot_without_config_is_reported(offline_home: Path) -> None:
    _fake_cache(offline_home, "org/partial", {"model.safetensors": "x"})
    with pytest.raises(HubError, match="org/partial.*no config.json"):
        resolve("org/partial")


def test_download_requests_only_the_files_lily_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    calls = []
    target = tmp_path / "snap"
    target.mkdir()
    (target / "config.json").write_text("{}")

    def fake_snapshot_download(repo_id: str, **kwargs):
        calls.append((repo_id, kwargs))
        return str(target)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve("Qwen/Qwen3.6-35B-A3B", revision="abc") == target
    ((repo_id, kwargs),) = calls
    assert repo_id == "Qwen/Qwen3.6-35B-A3B"
    assert kwargs["revision"] == "abc"
    assert kwargs["local_files_only"] is False
    assert Path(kwargs["cache_dir"]) == tmp_path / "home" / "hub"
    assert "tqdm_class" not in kwargs  # huggingface_hub's own tqdm bars
    resolve("Qwen/Qwen3.6-35B-A3B", progress=False)
    silent = calls[-1][1]["tqdm_class"]
    assert silent(total=3).disable

    patterns = kwargs["allow_patterns"]
    wanted = [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00026.safetensors",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ]
    unwanted = [
        "README.md",
        ".gitattributes",
        "LICENSE",
        "figures/benchmark.png",
        "original/consolidated.pth",
        "model-Q4_K_M.gguf",
        "pytorch_model.bin",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    ]
    matches = lambda f: any(fnmatch.fnmatch(f, p) for p in patterns)
    assert all(matches(f) for f in wanted), [f for f in wanted if not matches(f)]
    assert not any(matches(f) for f in unwanted), [f for f in unwanted if matches(f)]


def test_download_errors_are_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/org/gone"))

    def missing(repo_id: str, **kwargs):
        raise RepositoryNotFoundError("404", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(HubError, match="org/gone was not found"):
        resolve("org/gone")
    with pytest.raises(HubError, match="neither an existing directory nor"):
        resolve("not a repo id")
    with pytest.raises(HubError, match="revision"):
        resolve("lily:demo", revision="main")


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.hub_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    assert hub.hub_cache_dir() == tmp_path / "h" / "hub"
