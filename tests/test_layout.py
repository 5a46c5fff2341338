"""The repository's layout rules, checked on the files themselves.

One name per op: every ``metal/<op>.metal`` has its dispatch ``src/lily_ext/ops/<op>.cpp`` (opening with a comment that
names the kernel file), its cases ``python/lily/kernel_cases/<op>.py`` (listed in ``lily.kernel_cases.OPS``), its test
``tests/kernels/test_<op>.py`` and a row of the index table in docs/kernels.md whose reference resolves to a function
named as the op (a prefill op shares its decode op's). Imports in ``python/lily``
run only downward: cli -> server (and the other tools) -> model -> its helpers -> backends -> reference, checkpoint,
quant, config.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from lily import kernel_cases

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "lily"
DISPATCH_HELPERS = {"common"}  # src/lily_ext/ops/common.cpp: shared by every op file, dispatches nothing itself
NON_OP_KERNEL_TESTS = {"registry"}  # tests/kernels/test_registry.py: checks every kernel, belongs to no op
CASE_HELPERS = {"__init__", "common"}  # python/lily/kernel_cases: the registry and what every op's cases share


def ops_with(folder: Path, pattern: str, prefix: str = "") -> set[str]:
    return {p.stem.removeprefix(prefix) for p in folder.glob(pattern)}


def kernels_md_index() -> dict[str, list[str]]:
    """op -> [kernels, dispatch, reference, cases, test] from the index table of docs/kernels.md (backquotes
    removed)."""
    text = (ROOT / "docs" / "kernels.md").read_text()
    section = text.split("## Index", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 6 and cells[0] not in ("op", "---"):
            rows[cells[0]] = cells[1:]
    return rows


def test_every_kernel_file_has_a_dispatch_a_test_and_an_index_row() -> None:
    ops = ops_with(ROOT / "metal", "*.metal")
    dispatch = ops_with(ROOT / "src" / "lily_ext" / "ops", "*.cpp") - DISPATCH_HELPERS
    tests = ops_with(ROOT / "tests" / "kernels", "test_*.py", "test_") - NON_OP_KERNEL_TESTS
    cases = ops_with(PACKAGE / "kernel_cases", "*.py") - CASE_HELPERS
    index = kernels_md_index()
    assert ops, "no kernel files found"
    assert dispatch == ops, f"dispatch files without a kernel file: {sorted(dispatch - ops)}; " \
                            f"kernel files without src/lily_ext/ops/<op>.cpp: {sorted(ops - dispatch)}"
    assert tests == ops, f"kernel tests without a kernel file: {sorted(tests - ops)}; " \
                         f"kernel files without tests/kernels/test_<op>.py: {sorted(ops - tests)}"
    assert cases == ops == set(kernel_cases.OPS), \
        f"case modules without a kernel file: {sorted(cases - ops)}; kernel files without " \
        f"python/lily/kernel_cases/<op>.py: {sorted(ops - cases)}; lily.kernel_cases.OPS: {kernel_cases.OPS}"
    assert set(index) == ops, f"docs/kernels.md index rows without a kernel file: {sorted(set(index) - ops)}; " \
                              f"kernel files without an index row: {sorted(ops - set(index))}"


@pytest.mark.parametrize("op", sorted(kernels_md_index()))
def test_index_row_names_the_ops_files_and_reference(op: str) -> None:
    kernels, dispatch, reference, cases, test = kernels_md_index()[op]
    assert [kernels, dispatch, cases, test] == [f"metal/{op}.metal", f"src/lily_ext/ops/{op}.cpp",
                                                f"python/lily/kernel_cases/{op}.py", f"tests/kernels/test_{op}.py"]
    for path in (kernels, dispatch, cases, test):
        assert (ROOT / path).is_file(), f"docs/kernels.md names {path}, which does not exist"
    first_line = (ROOT / dispatch).read_text().splitlines()[0]
    assert first_line.startswith("//") and kernels in first_line, \
        f"{dispatch} must open with a comment naming the kernels it dispatches ({kernels}); got {first_line!r}"
    module, _, name = reference.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name, None)), f"{reference} is not a function"
    if module == "lily.reference":
        assert name == op.removesuffix("_prefill"), f"lily.reference.{name} must be named as the op {op!r}"


# Layers from the top; a module may import only from its own layer or below.
LAYERS = [
    ("lily.cli",),
    ("lily.server", "lily.bench", "lily.selftest", "lily.plan", "lily"),
    ("lily.model",),
    ("lily.tokenizer", "lily.chat", "lily.hub", "lily.snapshot", "lily.dummy"),
    ("lily.backends", "lily.cuda", "lily.kernel_cases"),
    # lily.sampling: the CPU sampler, which the metal backend keeps for requests the GPU cannot sample
    ("lily.reference", "lily.checkpoint", "lily.quant", "lily.config", "lily.sampling"),
    ("lily._ext", "lily._build"),
]
# Modules the build writes (CMakeLists.txt), absent from the source tree.
BUILT_MODULES = ("lily._ext", "lily._build")


def layer_of(module: str) -> int:
    """The layer of a module: its longest listed prefix (a package stands for its modules; "lily" for itself only)."""
    matches = [(len(name), i) for i, names in enumerate(LAYERS) for name in names
               if module == name or (name != "lily" and module.startswith(name + "."))]
    assert matches, f"{module} is in no layer: add it to LAYERS in tests/test_layout.py"
    return max(matches)[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every lily module `path` imports, at any depth (function-level imports included)."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*submodule.split("."))).with_suffix(".py").is_file() or \
                    (PACKAGE.parent / Path(*submodule.split("."))).is_dir()
                found.add(submodule if is_module or submodule in BUILT_MODULES else base)
    return {m for m in found if m == "lily" or m.startswith("lily.")}


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        this = module_name(path)
        for target in sorted(imported_modules(path)):
            if layer_of(target) < layer_of(this):
                bad.append(f"{this} imports {target}")
    return bad


def test_imports_run_only_downward() -> None:
    assert len(list(PACKAGE.rglob("*.py"))) > 20
    assert upward_imports() == []


def test_import_check_sees_an_upward_edge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself can fail: a reference module importing the model is reported."""
    assert layer_of("lily.server.app") < layer_of("lily.model") < layer_of("lily.backends.metal") < \
        layer_of("lily.reference")
    fake = tmp_path / "lily"
    fake.mkdir()
    (fake / "model.py").write_text("")
    (fake / "reference.py").write_text("from lily import model\nfrom lily.model import Model\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert upward_imports() == ["lily.reference imports lily.model"]


def test_server_and_backends_are_packages() -> None:
    for package in ("server", "backends"):
        assert (PACKAGE / package / "__init__.py").is_file()
    assert not re.search(r"^server_\w+\.py$", "\n".join(p.name for p in PACKAGE.glob("*.py")), re.M)


def test_switch_lists_name_the_same_switches() -> None:
    """lily.backends.engine.SWITCHES is the list; docs/engine.md's table, model.h's Switches and bindings.cpp follow
    (bindings.cpp binds each switch and each of TEST_OPTIONS onto lily::Switches under its own name)."""
    from lily.backends.engine import SWITCHES, TEST_OPTIONS

    table = (ROOT / "docs" / "engine.md").read_text().split("| switch | off means |", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `([A-Z0-9_]+)` \|", table, re.M)
    model_h = (ROOT / "src" / "lily_ext" / "model.h").read_text()
    members = re.findall(r"^\s*bool (\w+) = true;\s*// ([A-Z0-9_]+):", model_h.split("struct Switches", 1)[1], re.M)
    bound = re.findall(r'\.def_rw\("(\w+)", &S::\1\)', (ROOT / "src/lily_ext/bindings.cpp").read_text())
    assert sorted(name.upper() for name in SWITCHES) == sorted(documented)
    assert sorted(SWITCHES) == sorted(m for m, _ in members) and all(m.upper() == c for m, c in members)
    assert sorted(SWITCHES + TEST_OPTIONS) == sorted(bound)


# ---- size: no file over 800 lines, no function over 80, in python/ and src/lily_ext/ ----

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80
sys.path.insert(0, str(ROOT / "tools"))
from msl_text import blank_comments  # noqa: E402

# A brace that opens a function body: its head ends with the parameter list and qualifiers, and is no control flow.
FUNCTION_HEAD = re.compile(r"\)\s*(?:const\b|noexcept\b|override\b|final\b|mutable\b|->\s*[\w:<>,\s*&]+|\s)*$")
CONTROL_FLOW = re.compile(r"\b(?:if|for|while|switch|catch)\s*\(.*\)\s*$", re.S)


def sized_sources() -> list[Path]:
    return sorted([*(ROOT / "python").rglob("*.py"), *(ROOT / "src" / "lily_ext").rglob("*.cpp"),
                   *(ROOT / "src" / "lily_ext").rglob("*.h")])


def python_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """(head, line of its "{", lines to its "}") of every outermost function body (lambdas and blocks inside count
    toward theirs), found by matching braces in the code with comments and strings blanked."""
    code = blank_comments(text)
    found, scopes, head_start = [], [], 0  # scopes: (offset of "{", its head if it opens an outermost function)
    for m in re.finditer(r"[{};]", code):
        if m.group() == "{":
            head = code[head_start : m.start()]
            is_function = FUNCTION_HEAD.search(head) and not CONTROL_FLOW.search(head)
            outermost = not any(function_head for _, function_head in scopes)
            scopes.append((m.start(), " ".join(head.split()) if is_function and outermost else None))
        elif m.group() == "}" and scopes:
            opened, function_head = scopes.pop()
            if function_head:
                found.append((function_head, code.count("\n", 0, opened) + 1, code.count("\n", opened, m.start()) + 1))
        head_start = m.end()
    return found


def oversized(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Each file over MAX_FILE_LINES and each function over MAX_FUNCTION_LINES, as "path[:line]: what"."""
    found = []
    for path in paths:
        text = path.read_text()
        where = str(path.relative_to(root))
        if text.count("\n") > MAX_FILE_LINES:
            found.append(f"{where}: {text.count(chr(10))} lines")
        functions = python_functions(text) if path.suffix == ".py" else cpp_functions(text)
        found += [f"{where}:{line}: {name} has {length} lines" for name, line, length in functions
                  if length > MAX_FUNCTION_LINES]
    return found


def test_no_file_over_800_lines_and_no_function_over_80() -> None:
    paths = sized_sources()
    assert len(paths) > 60
    assert oversized(paths) == []


def test_size_check_sees_a_long_function_and_file(tmp_path: Path) -> None:
    """The check itself can fail: an 81-line function in either language and an 801-line file are reported; an
    80-line one is not, and lambdas, blocks and braces in comments or strings count toward their function."""
    statements = "".join(f"  x += {i};\n" for i in range(78))
    cpp = tmp_path / "a.cpp"
    cpp.write_text("namespace a {\n"
                   f"int f(int x) const {{\n{statements}}}\n"  # 80 lines from "{" to "}"
                   "auto g = [](int x) -> int {\n  if (x) {\n    x = 1;\n  }  // }\n  s = \"}\";\n"
                   f"{statements}}}\n"  # 84 lines
                   "}  // namespace a\n")
    py = tmp_path / "b.py"
    py.write_text("def f(x):\n" + "".join(f"    x += {i}\n" for i in range(80)) + "\n" * 720)
    assert oversized([cpp, py], tmp_path) == ["a.cpp:82: auto g = [](int x) -> int has 84 lines", "b.py: 801 lines",
                                              "b.py:1: f has 81 lines"]


# What crashed the CUDA driver layer in the H200's g++ 13 build (libstdc++ linked into the module): std::regex's
# compiler (2026-12-02) and formatting a number through an ostream (2026-12-04), both in libstdc++'s locale code.
CUDA_LAYER_FORBIDDEN = re.compile(r"#include <(regex|sstream|iomanip|locale)>|std::(regex|[io]?stringstream|locale)\b")


def locale_uses(paths: list[Path]) -> list[str]:
    """`file:line: text` of every line of `paths` whose code (before a `//` comment) uses what CUDA_LAYER_FORBIDDEN
    names."""
    return [f"{path.name}:{number}: {line.strip()}" for path in paths
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if CUDA_LAYER_FORBIDDEN.search(line.split("//", 1)[0])]


def test_the_cuda_layer_uses_no_regex_or_string_streams() -> None:
    paths = sorted((ROOT / "src" / "lily_ext" / "cuda").glob("*.[ch]*"))
    assert len(paths) >= 6
    assert locale_uses(paths) == []


def test_the_locale_check_sees_a_string_stream(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("#include <sstream>\nstd::ostringstream s;\n"
                   "std::string ok = std::to_string(3);  // not std::regex\n")
    assert locale_uses([bad]) == ["bad.cpp:1: #include <sstream>", "bad.cpp:2: std::ostringstream s;"]
