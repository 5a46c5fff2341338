"""Reading Metal source text, one definition for every tool and test: comments blanked, top-level splitting, and the
kernel host names a source instantiates.

A host name is what the host looks a kernel up by: the name of a `template [[host_name("x")]] [[kernel]] ...`
instantiation or of a `LILY_INSTANTIATE_KERNEL("x", ...)` (metal/lily.h), or the name of a plain kernel that is not a
template. tools/msl2cpu.py registers the harness kernels and writes each family's host names into the extension
(src/lily_ext/kernel_family.h) with these patterns; the tests read the names with `host_names`.
"""

from __future__ import annotations

import re

KERNEL_RE = re.compile(r"(?:\[\[\s*kernel\s*\]\]|\bkernel\b)\s*(?:\[\[[^\]]*\]\]\s*)*void\s+(\w+)\s*\(")
TEMPLATE_BEFORE_RE = re.compile(r"template\s*<[^;{}]*>\s*$")
# `template [[host_name("x")]] [[kernel]] decltype(f<T>) f<T>;`: host name, function, its arguments, again.
INSTANTIATION_RE = re.compile(
    r"template\s*\[\[\s*host_name\s*\(\s*\"([^\"]+)\"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*"
    r"decltype\s*\(\s*(\w+)\s*<(.*?)>\s*\)\s*(\w+)\s*<(.*?)>\s*;",
    re.S,
)
# LILY_INSTANTIATE_EARLY_KERNEL: the same, for a kernel that waits for its producers itself (metal/lily.h).
MACRO_INSTANTIATION_RE = re.compile(r"\bLILY_INSTANTIATE(?:_EARLY)?_KERNEL\s*\(\s*\"([^\"]+)\"")


def blank_comments(text: str) -> str:
    """Comments and the contents of string literals replaced by spaces, keeping every offset and newline."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = [c if c == "\n" else " " for c in text[i:j]]
            i = j
        elif text[i] == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            out[i + 1 : j] = " " * (j - i - 1)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def split_top_level(params: str) -> list[str]:
    """`params` split at the commas outside (), <> and []."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(params):
        depth += {"(": 1, "<": 1, "[": 1, ")": -1, ">": -1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(params[start:i])
            start = i + 1
    if params[start:].strip():
        parts.append(params[start:])
    return parts


def is_template_kernel(code: str, match: re.Match) -> bool:
    """Whether the KERNEL_RE match in comment-blanked `code` is a template (instantiated under host names)."""
    return TEMPLATE_BEFORE_RE.search(code[: match.start()].rstrip()) is not None


def host_names(source: str) -> list[str]:
    """The host names `source` instantiates, in source order (a name given twice is listed twice)."""
    code = blank_comments(source)
    found = [(m.start(), source[m.start(1) : m.end(1)])
             for pattern in (INSTANTIATION_RE, MACRO_INSTANTIATION_RE) for m in pattern.finditer(code)]
    found += [(m.start(), m.group(1)) for m in KERNEL_RE.finditer(code) if not is_template_kernel(code, m)]
    return [name for _, name in sorted(found)]
