"""Every instantiated kernel is registered in the harness and tested by some tests/kernels/test_*.py.

Host names are read from metal/*.metal (`[[host_name("...")]]`, `LILY_INSTANTIATE_KERNEL("...", ...)` and plain
`[[kernel]]` functions that are not templates)
and must equal `lily._ext.msl.kernel_names()`; a name is tested when it appears in a kernel test file.
"""

from __future__ import annotations

import re
from pathlib import Path

from lily._ext import msl

ROOT = Path(__file__).resolve().parents[2]
INSTANTIATION = re.compile(r'\[\[\s*host_name\s*\(\s*"([^"]+)"\s*\)\s*\]\]|LILY_INSTANTIATE_KERNEL\s*\(\s*"([^"]+)"')
# A kernel that is not a template is its own host name.
KERNEL = re.compile(r"\[\[\s*kernel\s*\]\]\s*void\s+(\w+)\s*\(")


def source_host_names() -> list[str]:
    names = []
    for path in sorted((ROOT / "metal").glob("*.metal")):
        text = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
        names += [a or b for a, b in INSTANTIATION.findall(text)]
        names += [m.group(1) for m in KERNEL.finditer(text) if not text[: m.start()].rstrip().endswith(">")]
    return names


def test_sources_and_registry_agree() -> None:
    names = source_host_names()
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"host names instantiated twice: {duplicates}"
    registered = msl.kernel_names()
    assert sorted(names) == registered, (
        f"only in metal/*.metal: {sorted(set(names) - set(registered))}; "
        f"only in the registry: {sorted(set(registered) - set(names))}"
    )
    assert not set(registered) & set(msl.test_kernel_names()), "harness self-test kernels leaked into the registry"


def kernel_test_coverage() -> tuple[list[str], list[str]]:
    """(every registered kernel name, the names some kernel test file mentions)."""
    test_text = "\n".join(
        p.read_text() for p in sorted((ROOT / "tests" / "kernels").glob("test_*.py")) if p.name != Path(__file__).name
    )
    names = msl.kernel_names()
    return names, [n for n in names if re.search(rf'["\']{re.escape(n)}["\']', test_text)]


def test_every_kernel_is_tested() -> None:
    names, tested = kernel_test_coverage()
    assert names, "no kernels registered"
    assert tested == names, f"untested kernels: {sorted(set(names) - set(tested))}"
