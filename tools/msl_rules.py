"""Metal Shading Language rules that clang accepts through the CPU shim but Apple's compiler rejects.

tools/msl2cpu.py runs `check` on every kernel file (and the local headers it includes) before rewriting it, for
every target, so a violating kernel fails the build here as it would on a Mac. docs/verification.md lists the
rules; each message starts with the rule's name in brackets. What needs types (element types of simdgroup
matrices, address spaces of arguments) is checked by the shim itself (src/msl_cpu/include/msl_cpu.h).
"""

from __future__ import annotations

import re
from pathlib import Path

from msl_text import KERNEL_RE, blank_comments, split_top_level

# The language version of Lily's kernel libraries (MTLLanguageVersion3_1: macOS 14, bfloat, simdgroup_matrix) and of
# the separate library of Metal 4 tensor-op kernels, built only on devices that support Metal 4.
BASE_METAL_VERSION = 310
TENSOR_OPS_METAL_VERSION = 400

RULES = {
    "program-scope-constant": "program-scope and static variables (static data members included) must be declared "
                              "in the `constant` address space (MSL §4.2), e.g. "
                              "`static constant constexpr int N = 4;`",
    "position-attribute-width": "the thread/threadgroup position and size attributes of one kernel must all be "
                                "scalars or all vectors of one width (MSL §5.2.3)",
    "barrier-mem-flags": "threadgroup_barrier needs mem_flags, and mem_flags::mem_none does not make threadgroup "
                         "memory written before the barrier visible to other threads: use mem_flags::mem_threadgroup",
    "unqualified-pointer": "a pointer needs an address space (device, constant, threadgroup or thread)",
    "atomic-version": "atomic_float needs MSL 3.0 and 64-bit atomics (atomic_ulong: min/max only, Apple8+) MSL 3.1",
    "bfloat-version": "bfloat needs MSL 3.1",
    "memory-order": "Metal atomics take memory_order_relaxed only",
    "no-double": "Metal has no double-precision type: `double` and `long double` are rejected by Apple's compiler "
                 "(MSL §2.1); use float",
    "threadgroup-scope": "threadgroup variables may be declared only in a kernel function's body (or bound as "
                         "[[threadgroup(i)]] kernel parameters), not at program scope, in a struct or in a helper",
}

# Position attributes whose types must agree in width (the thread_index/simd attributes are always scalars).
VECTOR_POSITION_ATTRS = {
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "dispatch_threads_per_threadgroup",
}
ADDRESS_SPACES = {"device", "constant", "threadgroup", "thread", "threadgroup_imageblock", "ray_data", "object_data"}
VERSIONED = [  # (pattern, minimum __METAL_VERSION__, rule)
    (re.compile(r"\batomic_float\b|\batomic\s*<\s*float\s*>"), 300, "atomic-version"),
    (re.compile(r"\batomic_u?long\b|\batomic\s*<\s*(?:u?long|u?int64_t|size_t)\s*>"), 310, "atomic-version"),
    (re.compile(r"\bbfloat[234]?\b"), 310, "bfloat-version"),
]

ATTR_RE = re.compile(r"\[\[\s*(\w+)\s*(?:\([^)]*\))?\s*\]\]")
MACRO_CALL_RE = re.compile(r"^[ \t]*[A-Z][A-Z0-9_]+\s*\(", re.M)
DIRECTIVE_RE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
LOCAL_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
THREADGROUP_DECL_RE = re.compile(
    r"^\s*(?:static\s+)?threadgroup\s+[\w:<>, ]+?\s+\w+\s*(?:\[[^\]]*\]\s*)*(?:=.*)?$", re.S)
POINTER_DECL_RE = re.compile(  # `[const] Type[<...>] *name [= ...]`: the type is group 1
    r"^\s*((?:const\s+|volatile\s+)*[A-Za-z_][\w:]*(?:\s*<[^;{}()]*>)?)\s*\*+\s*(?:const\s+)?\w+\s*(?:=|$)")
SCALAR_WIDTH = {"uint": 1, "ushort": 1, "int": 1, "short": 1}


class RuleViolation(Exception):
    """Kernel source that Apple's compiler would reject; the message names the file, line and rule."""


def _blank(text: str) -> str:
    """Comments, string literals and preprocessor lines replaced by spaces (offsets and newlines kept)."""
    code = blank_comments(text)
    # Directives, with their backslash-continued lines.
    code = DIRECTIVE_RE.sub(lambda m: "".join(ch if ch == "\n" else " " for ch in m.group(0)), code)
    # Macro invocations at the start of a line (LILY_INSTANTIATE_KERNEL(...)) are not statements: blank them.
    n = len(code)
    for m in reversed(list(MACRO_CALL_RE.finditer(code))):
        depth, j = 1, m.end()
        while depth and j < n:
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            j += 1
        code = code[: m.start()] + "".join(ch if ch == "\n" else " " for ch in code[m.start() : j]) + code[j:]
    return code


class _Checker:
    def __init__(self, source: str, path: str, metal_version: int):
        self.path, self.version = path, metal_version
        self.code = _blank(source)
        self.errors: list[str] = []

    def fail(self, offset: int, rule: str, detail: str) -> None:
        line = self.code.count("\n", 0, offset) + 1
        self.errors.append(f"{self.path}:{line}: [{rule}] {detail}: {RULES[rule]}")

    def run(self) -> list[str]:
        self.scan_scopes()
        self.check_text_rules()
        return self.errors

    def check_text_rules(self) -> None:
        code = self.code
        for m in re.finditer(r"\b(?:long\s+)?double\b", code):
            self.fail(m.start(), "no-double", m.group(0))
        for m in re.finditer(r"\bmemory_order_(\w+)", code):
            if m.group(1) != "relaxed":
                self.fail(m.start(), "memory-order", f"memory_order_{m.group(1)}")
        for pattern, minimum, rule in VERSIONED:
            if self.version < minimum:
                for m in pattern.finditer(code):
                    self.fail(m.start(), rule, f"{m.group(0)} at __METAL_VERSION__ {self.version}")

    def scan_scopes(self) -> None:
        """Walk braces, classifying each scope, and check statements, function heads and barriers in it."""
        code = self.code
        stack: list[tuple[str, bool, int]] = []  # (kind, inside a kernel, offset of the opening brace)
        start = 0  # where the current statement (or scope head) began
        for i, c in enumerate(code):
            if c == "{":
                head = code[start:i]
                outer = stack[-1] if stack else ("namespace", False, 0)
                if outer[0] in ("function", "block"):
                    kind, is_kernel = "block", outer[1]
                elif re.search(r"\bnamespace\b", head):
                    kind, is_kernel = "namespace", False
                elif re.search(r"\benum\b", head):
                    kind, is_kernel = "enum", False
                elif re.search(r"\b(struct|class|union)\b", head) and ")" not in head.split("{")[-1].split(":")[0]:
                    kind, is_kernel = "type", False
                elif ")" in head and "=" not in head.split("(")[0]:
                    kind, is_kernel = "function", bool(KERNEL_RE.search(head))
                    self.check_function_head(head, start, is_kernel)
                else:
                    kind, is_kernel = "init", outer[1]
                stack.append((kind, is_kernel, i))
                start = i + 1
            elif c == "}":
                if stack:
                    kind, _, opened = stack.pop()
                    if kind == "function":
                        self.check_barriers(opened, i)
                start = i + 1
            elif c == ";":
                kind, is_kernel, _ = stack[-1] if stack else ("namespace", False, 0)
                if kind != "init":
                    self.check_statement(code[start:i], start, kind, is_kernel)
                start = i + 1

    def check_statement(self, stmt: str, offset: int, scope: str, in_kernel: bool) -> None:
        text = ATTR_RE.sub(lambda m: " " * len(m.group(0)), stmt)
        lead = len(text) - len(text.lstrip())
        at = offset + lead
        text = text.strip()
        if not text or re.match(r"(typedef|using|static_assert|template|friend|return|namespace|extern)\b", text):
            return
        words = set(re.findall(r"\w+", text.split("=")[0]))
        if THREADGROUP_DECL_RE.match(text) and (scope in ("namespace", "type") or not in_kernel):
            where = {"namespace": "at program scope", "type": "in a struct"}.get(scope, "in a helper function")
            self.fail(at, "threadgroup-scope", f"threadgroup variable {where}")
            return
        if scope in ("function", "block", "type"):
            m = POINTER_DECL_RE.match(text)
            if m and not (set(m.group(1).split()) & (ADDRESS_SPACES | {"auto", "return", "else", "case"})):
                self.fail(at, "unqualified-pointer", f"'{' '.join(text.split('=')[0].split())}'")
        if scope in ("function", "block"):
            if text.startswith("static ") and "constant" not in words:
                self.fail(at, "program-scope-constant", "static local variable without `constant`")
            return
        declarator = text.split("=")[0]
        if "(" in declarator or scope == "enum":
            return  # a function declaration (or an enumerator list)
        if scope == "type" and not re.match(r"static\b", text):
            return  # an ordinary data member
        if "constant" not in words:
            what = "static data member" if scope == "type" else "program-scope variable"
            self.fail(at, "program-scope-constant", f"{what} '{' '.join(declarator.split())}' without `constant`")

    def check_function_head(self, head: str, offset: int, is_kernel: bool) -> None:
        close = head.rfind(")")
        depth, open_ = 0, close
        while open_ >= 0:
            depth += {")": 1, "(": -1}.get(head[open_], 0)
            if depth == 0:
                break
            open_ -= 1
        if open_ < 0:
            return
        at = offset + open_
        widths = {}
        for param in split_top_level(head[open_ + 1 : close]):
            ptype = ATTR_RE.sub("", param).split("=")[0].strip()  # not a default argument's product
            if "*" in ptype and not set(re.findall(r"\w+", ptype.split("*")[0])) & ADDRESS_SPACES:
                self.fail(at, "unqualified-pointer", f"parameter '{' '.join(ptype.split())}'")
            for attr in ATTR_RE.findall(param):
                if attr in VECTOR_POSITION_ATTRS:
                    m = re.search(r"\b(u?int|u?short)([234]?)\b", ptype)
                    widths[attr] = int(m.group(2) or 1) if m else 0
        if is_kernel and len(set(widths.values())) > 1:
            found = ", ".join(f"{a} ({'scalar' if w == 1 else f'vector of {w}'})" for a, w in widths.items())
            self.fail(at, "position-attribute-width", found)

    def check_barriers(self, opened: int, closed: int) -> None:
        body = self.code[opened:closed]
        head_start = max(self.code.rfind(";", 0, opened), self.code.rfind("}", 0, opened)) + 1
        uses_threadgroup = re.search(r"\bthreadgroup\b", self.code[head_start:closed]) is not None
        for m in re.finditer(r"\bthreadgroup_barrier\s*\(([^)]*)\)", body):
            flags = m.group(1)
            if not flags.strip():
                self.fail(opened + m.start(), "barrier-mem-flags", "threadgroup_barrier() without mem_flags")
            elif uses_threadgroup and re.fullmatch(r"\s*(?:metal::)?mem_flags::mem_none\s*", flags):
                self.fail(opened + m.start(), "barrier-mem-flags",
                          "threadgroup_barrier(mem_flags::mem_none) in a function that uses threadgroup memory")


def kernel_attribute_widths(source: str) -> list[tuple[str, dict[str, int]]]:
    """Each kernel's vector-position attributes and their widths (1 = scalar), for tests that scan signatures."""
    code = _blank(source)
    out = []
    for m in KERNEL_RE.finditer(code):
        depth, i = 1, m.end()
        while depth and i < len(code):
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        widths = {}
        for param in split_top_level(code[m.end() : i - 1]):
            for attr in ATTR_RE.findall(param):
                if attr in VECTOR_POSITION_ATTRS:
                    t = re.search(r"\b(u?int|u?short)([234]?)\b", param)
                    widths[attr] = int(t.group(2) or 1) if t else 0
        out.append((m.group(1), widths))
    return out


def check(source: str, path: str, metal_version: int = BASE_METAL_VERSION) -> list[str]:
    """Every rule violation in one MSL source (not its includes), as 'path:line: [rule] detail: rule text'."""
    return _Checker(source, path, metal_version).run()


def check_file(path: Path, metal_version: int = BASE_METAL_VERSION) -> None:
    """Checks a .metal file and the local headers it includes ("lily.h"); raises RuleViolation listing them all."""
    errors, seen, todo = [], set(), [path]
    while todo:
        p = todo.pop()
        if p.resolve() in seen or not p.exists():
            continue
        seen.add(p.resolve())
        text = p.read_text()
        errors += check(text, str(p), metal_version)
        todo += [p.parent / name for name in LOCAL_INCLUDE_RE.findall(text)]
    if errors:
        raise RuleViolation("\n".join(errors))


def uses_tensor_ops(source: str) -> bool:
    """Whether a kernel file has Metal 4 tensor-op kernels (it includes <metal_tensor>)."""
    return re.search(r"^[ \t]*#[ \t]*include[ \t]*<metal_tensor>", source, re.M) is not None
