"""Prepare what the peer benchmark carries to the GPU machine (which has no network): llama.cpp's source pruned to what
a CUDA ``llama-bench`` build and the bundled gguf-py need, as ``.dev/peer/llama.cpp.tar.gz`` (about 6 MB), with the
commit it is in ``.dev/peer/llama.cpp.commit``.

    python scripts/peer_bench/prepare.py [--source LLAMA_CPP_DIR --commit SHA]

Without ``--source``: the llama.cpp that the llama-cpp-python 0.3.36 source distribution vendors (fetched with pip;
its changelog names ggml-org/llama.cpp@0c1e57098, the commit docs/performance.md's earlier peer runs used, with
``qwen35moe`` support). Kept: the CMake files, ggml with its CPU and CUDA backends only, src, include, common,
tools/llama-bench (tools/CMakeLists.txt cut down to it), vendor headers, gguf-py, the licenses. Left out: the web UI
and server, examples, tests, docs, model vocabularies, the other tools, the non-CUDA GPU backends.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".dev" / "peer"
SDIST = ("llama-cpp-python", "0.3.36", "0c1e57098")  # package, version, the llama.cpp commit its changelog names
KEEP_TOP = ("CMakeLists.txt", "CMakePresets.json", "LICENSE", "cmake", "common", "ggml", "gguf-py", "include",
            "licenses", "src", "tools", "vendor")
KEEP_GGML_SRC_DIRS = ("ggml-cpu", "ggml-cuda")  # every other ggml/src/ggml-* directory is a backend not built here
TOOLS_CMAKE = ("# pruned for the peer benchmark (scripts/peer_bench/prepare.py): llama-bench only\n"
               "add_subdirectory(llama-bench)\n")


def fetch_sdist(work: Path) -> Path:
    """The vendored llama.cpp tree of the llama-cpp-python source distribution."""
    package, version, _ = SDIST
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"{package}=={version}", "-d", str(work)], check=True)
    archive = next(work.glob("*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"


def prune(source: Path, dest: Path) -> None:
    """Copy the parts of ``source`` a CUDA llama-bench build needs into ``dest``."""
    for name in KEEP_TOP:
        if (source / name).is_dir():
            shutil.copytree(source / name, dest / name, ignore=shutil.ignore_patterns(".git*", "*.metal", "*.md"))
        elif (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    for backend in (dest / "ggml" / "src").glob("ggml-*"):
        if backend.is_dir() and backend.name not in KEEP_GGML_SRC_DIRS:
            shutil.rmtree(backend)
    for tool in (dest / "tools").iterdir():
        if tool.is_dir() and tool.name != "llama-bench":
            shutil.rmtree(tool)
    (dest / "tools" / "CMakeLists.txt").write_text(TOOLS_CMAKE)
    for heavy in ("gguf-py/tests", "gguf-py/examples"):
        shutil.rmtree(dest / heavy, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=None, help="a llama.cpp tree (default: the sdist's)")
    parser.add_argument("--commit", default=None, help="the commit of --source")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.source is None:
            source, commit = fetch_sdist(work), f"ggml-org/llama.cpp@{SDIST[2]} (vendored by {SDIST[0]} {SDIST[1]})"
        else:
            source, commit = args.source, f"ggml-org/llama.cpp@{args.commit or 'unknown'}"
        if "qwen35moe" not in (source / "src" / "llama-arch.cpp").read_text():
            raise SystemExit(f"{source}: this llama.cpp has no qwen35moe architecture")
        tree = work / "llama.cpp"
        tree.mkdir()
        prune(source, tree)
        archive = OUT / "llama.cpp.tar.gz"
        with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
            tar.add(tree, arcname="llama.cpp")
    (OUT / "llama.cpp.commit").write_text(commit + "\n")
    print(f"{archive}: {archive.stat().st_size / 1e6:.1f} MB, {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
