#!/usr/bin/env python3
"""Rewrite a Metal (.metal) source into C++ for the CPU execution harness (run by CMake at build time).

Macros in src/msl_cpu/include/msl_cpu.h cover most of MSL; this script handles what macros cannot
(docs/harness.md):
  1. `threadgroup T name[N];` (or a scalar `threadgroup T name;`) in a function body becomes a reference into the threadgroup's shared arena;
  2. bool function constants become constexpr values; every defined/undefined/true/false combination
     is compiled as its own variant namespace;
  3. `template [[host_name("x")]] [[kernel]] decltype(f<T>) f<T>;` becomes a registration;
  4. every kernel signature becomes a table of parameter attributes ([[buffer(i)]], positions, ...).
Line numbers are kept (with #line), so compiler errors point into the .metal file.

Before rewriting, tools/msl_rules.py checks the file against the Metal rules that clang would let through (both
targets).

    msl2cpu.py SOURCE.metal OUT_DIR [--test-registry] [--metal-version N] -> OUT_DIR/<stem>.cpp, <stem>.body.inc
    msl2cpu.py --target cuda SOURCE.metal OUT_DIR      -> OUT_DIR/<stem>.cu (NVIDIA GPUs, docs/cuda.md)
    msl2cpu.py --embed OUT.cpp LILY_H SOURCE.metal...  -> one library per file, local headers inlined, as C++ strings
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

import msl_rules
from msl_text import INSTANTIATION_RE, KERNEL_RE, blank_comments, host_names, is_template_kernel, split_top_level

# The position attributes the harness binds: Metal's (msl_rules.py), less dispatch_threads_per_threadgroup.
POSITION_ATTRS = msl_rules.VECTOR_POSITION_ATTRS - {"dispatch_threads_per_threadgroup"} | {
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
    "thread_execution_width",
}
MAX_FUNCTION_CONSTANTS = 4  # 3**4 = 81 compiled variants

FUNCTION_CONSTANT_RE = re.compile(
    r"\bconstant\s+(\w+)\s+(\w+)\s*\[\[\s*function_constant\s*\(([^)]*)\)\s*\]\]\s*;"
)
THREADGROUP_ARRAY_RE = re.compile(
    r"^(\s*)threadgroup\s+([\w:<>, ]+?)\s+(\w+)\s*((?:\[[^\]\[()]+\])*)\s*;", re.M
)
HALF_LITERAL_RE = re.compile(r"(?<![\w.])(\d+\.\d*(?:[eE][+-]?\d+)?|\d*\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)h\b")
INCLUDE_RE = re.compile(r"^[ \t]*#[ \t]*include\b.*$", re.M)
ATTR_RE = re.compile(r"\[\[\s*(\w+)\s*(?:\(([^)]*)\))?\s*\]\]")


class RewriteError(Exception):
    """A construct the harness cannot translate; the message names the file and line."""


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def same_lines(original: str, replacement: str) -> str:
    """Pad a replacement with newlines so the lines after it keep their numbers."""
    return replacement + "\n" * (original.count("\n") - replacement.count("\n"))


def parse_kernels(code: str, path: str) -> list[tuple[str, bool, list[tuple[str, str]]]]:
    """Kernels in the file: (name, is_template, [(attribute, index expression)] per parameter)."""
    kernels = []
    for m in KERNEL_RE.finditer(code):
        depth, i = 1, m.end()
        while depth:
            if i >= len(code):
                raise RewriteError(f"{path}:{line_of(code, m.start())}: unbalanced parentheses in kernel {m.group(1)}")
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        attrs = []
        for k, param in enumerate(split_top_level(code[m.end() : i - 1])):
            found = [a for a in ATTR_RE.findall(param) if a[0] in POSITION_ATTRS | {"buffer", "threadgroup"}]
            if len(found) != 1:
                raise RewriteError(
                    f"{path}:{line_of(code, m.start())}: kernel {m.group(1)} parameter {k} needs exactly one "
                    f"[[buffer(i)]], [[threadgroup(i)]] or position attribute; got {param.strip()!r}"
                )
            name, index = found[0]
            attrs.append((name, index.strip() or "0"))
        kernels.append((m.group(1), is_template_kernel(code, m), attrs))
    return kernels


def rewrite(source: str, path: str, target: str = "cpu") -> tuple[str, list[str], list[tuple[str, str]], list]:
    """Returns (body, hoisted includes, function constants [(name, index expr)], kernels) for `target` ("cpu" or
    "cuda"; they differ only in how a function-scope threadgroup array is declared)."""
    code = blank_comments(source)
    body = list(source)  # edits keep offsets: every replacement has the length of what it replaces

    def replace(start: int, end: int, text: str) -> None:
        original = "".join(body[start:end])
        text = same_lines(original, text)
        if len(text) < len(original):
            text += " " * (len(original) - len(text))
        body[start:end] = [text] + [""] * (end - start - 1)

    includes = [source[m.start() : m.end()].strip() for m in INCLUDE_RE.finditer(code)]
    for m in INCLUDE_RE.finditer(code):
        replace(m.start(), m.end(), "")

    constants = []
    for m in FUNCTION_CONSTANT_RE.finditer(code):
        ctype, name, index = m.groups()
        if ctype != "bool":
            raise RewriteError(
                f"{path}:{line_of(code, m.start())}: function constant '{name}' is {ctype}; "
                "the CPU harness compiles bool function constants only (use a template parameter)"
            )
        k = len(constants)
        constants.append((name, index.strip()))
        replace(m.start(), m.end(), f"constexpr bool {name} = MSL_FC_{k}_VALUE;")
    if len(constants) > MAX_FUNCTION_CONSTANTS:
        raise RewriteError(f"{path}: more than {MAX_FUNCTION_CONSTANTS} function constants")
    for k, (name, _) in enumerate(constants):
        for m in re.finditer(rf"\bis_function_constant_defined\s*\(\s*{name}\s*\)", code):
            replace(m.start(), m.end(), f"MSL_FC_{k}_DEFINED")

    for m in INSTANTIATION_RE.finditer(code):
        host = source[m.start(1) : m.end(1)]
        fn, targs, fn2, targs2 = m.group(2), m.group(3).strip(), m.group(4), m.group(5).strip()
        if fn != fn2 or " ".join(targs.split()) != " ".join(targs2.split()):
            raise RewriteError(f"{path}:{line_of(code, m.start())}: instantiation of '{host}' names two functions")
        replace(m.start(), m.end(), f'MSL_CPU_INSTANTIATE("{host}", {fn}, {targs})')

    for m in THREADGROUP_ARRAY_RE.finditer(code):
        indent, ctype, name, dims = m.groups()
        key = f"{name}@{line_of(code, m.start())}"
        if target == "cuda":
            replace(m.start(), m.end(), cuda_threadgroup_array(indent, ctype.strip(), name, dims))
            continue
        replace(
            m.start(),
            m.end(),
            f'{indent}auto& {name} = *::msl_cpu_detail::threadgroup_array<{ctype.strip()}{dims}>("{key}");',
        )

    # `threadgroup` is an address-space macro in the shim: rename the attribute so it survives preprocessing.
    for m in re.finditer(r"\[\[\s*threadgroup\s*\(", code):
        replace(m.start(), m.end(), "[[msl_threadgroup(")
    for m in re.finditer(r"\bkernel(\s+void\b)", code):
        replace(m.start(), m.end(), "      " + m.group(1))
    text = "".join(body)
    code = blank_comments(text)
    pieces, last = [], 0
    for m in HALF_LITERAL_RE.finditer(code):
        pieces += [text[last : m.start()], f"half({m.group(1)}f)"]
        last = m.end()
    text = "".join(pieces) + text[last:]
    return text, includes, constants, parse_kernels(blank_comments(source), path)


def attr_table(name: str, attrs: list[tuple[str, str]]) -> str:
    kinds = {"threadgroup": "threadgroup_memory"}  # `threadgroup` is a macro in generated code
    rows = ", ".join(f"{{::msl_rt::Attr::{kinds.get(a, a)}, int({idx})}}" for a, idx in attrs)
    return f"static const ::msl_rt::ParamAttr msl_param_attrs_{name}[] = {{{rows}}};"


def generate(source_path: Path, out_dir: Path, test_registry: bool, metal_version: int) -> None:
    path = str(source_path)
    msl_rules.check_file(source_path, metal_version)
    body, includes, constants, kernels = rewrite(source_path.read_text(), path)
    stem = source_path.stem
    namespace = re.sub(r"\W", "_", stem)
    inc_name = f"{stem}.body.inc"
    plain = [f'MSL_CPU_INSTANTIATE_PLAIN("{name}", {name})' for name, is_tpl, _ in kernels if not is_tpl]
    (out_dir / inc_name).write_text(f'#line 1 "{source_path.resolve()}"\n{body}\n' + "\n".join(plain) + "\n")

    out = [
        f"// Generated by tools/msl2cpu.py from {source_path.name}; edit the .metal file instead.",
        f"#define MSL_CPU_METAL_VERSION {metal_version}",
        '#include "msl_cpu.h"',
        *includes,
        f"namespace msl_gen_{namespace} {{",
    ]
    # Each constant is undefined, false or true at pipeline creation: one compiled variant per combination.
    for v, states in enumerate(itertools.product((None, False, True), repeat=len(constants))):
        fcs = [f"{{int({idx}), {str(s is not None).lower()}, {str(bool(s)).lower()}}}"
               for (_, idx), s in zip(constants, states)]
        out += [
            f"namespace variant{v} {{",
            f"static constexpr int msl_registry_id = {1 if test_registry else 0};",
            f'static const char msl_source_file[] = "{source_path.name}";',
            f"static const ::msl_rt::FcState msl_variant_fcs[] = {{{', '.join(fcs) or '{0, false, false}'}}};",
            f"static constexpr int msl_variant_fc_count = {len(constants)};",
            *(attr_table(name, attrs) for name, _, attrs in kernels),
        ]
        for k, s in enumerate(states):
            out += [f"#define MSL_FC_{k}_DEFINED {str(s is not None).lower()}",
                    f"#define MSL_FC_{k}_VALUE {str(bool(s)).lower()}"]
        out.append(f'#include "{inc_name}"')
        out += [f"#undef MSL_FC_{k}_{w}" for k in range(len(states)) for w in ("DEFINED", "VALUE")]
        out.append(f"}}  // namespace variant{v}")
    out.append("}")
    target = out_dir / f"{stem}.cpp"
    text = "\n".join(out) + "\n"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


LOCAL_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)".*$', re.M)


# ---- CUDA target (docs/cuda.md): the same rewrite, compiled by clang in CUDA device mode through msl_cuda.h ----


def cuda_threadgroup_array(indent: str, ctype: str, name: str, dims: str) -> str:
    """A function-scope `threadgroup T name[N];` as a __shared__ variable seen through a threadgroup reference (its
    type spelled by decltype: `float4(*)[N]` would call the shim's float4(...) constructor macro)."""
    return (f"{indent}__shared__ __attribute__((aligned(16))) {ctype} msl_tg_{name}{dims}; "
            f"auto& {name} = *(threadgroup decltype(msl_tg_{name})*)&msl_tg_{name};")


def cuda_attr_table(name: str, attrs: list[tuple[str, str]]) -> str:
    """The attribute table as a constexpr array, so entry points read it at compile time on the device."""
    return attr_table(name, attrs).replace("static const ", "static constexpr ", 1)


def generate_cuda(source_path: Path, out_dir: Path) -> Path:
    """OUT_DIR/<stem>.cu: one extern "C" __global__ entry point per instantiation, named by its host name."""
    path = str(source_path)
    body, includes, constants, kernels = rewrite(source_path.read_text(), path, target="cuda")
    if constants:
        raise RewriteError(f"{path}: function constants are not supported by the CUDA target "
                           f"({', '.join(n for n, _ in constants)}); use template parameters")
    stem = source_path.stem
    namespace = re.sub(r"\W", "_", stem)
    plain = [f'MSL_CPU_INSTANTIATE_PLAIN("{name}", {name})' for name, is_tpl, _ in kernels if not is_tpl]
    out = [
        f"// Generated by tools/msl2cpu.py --target cuda from {source_path.name}; edit the .metal file instead.",
        '#include "msl_cuda.h"',
        *includes,
        f"namespace msl_gen_{namespace} {{",
        *(cuda_attr_table(name, attrs) for name, _, attrs in kernels),
        f'#line 1 "{source_path.resolve()}"',
        body,
        *plain,
        "}",
    ]
    target = out_dir / f"{stem}.cu"
    text = "\n".join(out) + "\n"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return target


def embed(out: Path, header: Path, sources: list[Path]) -> None:
    """One kernel library per .metal file (its family): lily.h, then the file with each of its local headers
    (metal/*.h) inlined where first included, with #line markers so Metal's diagnostics name the real file and line,
    and the host names it instantiates.

    A file with Metal 4 tensor-op kernels gets a second library at TENSOR_OPS_METAL_VERSION, which the engine builds
    only on devices that support them (src/lily_ext/device.cpp); its base library compiles without them.
    """

    def expand(path: Path, inlined: set[str]) -> str:
        inlined.add(path.name)
        out = [f'#line 1 "metal/{path.name}"']
        for number, line in enumerate(path.read_text().split("\n"), start=1):
            m = LOCAL_INCLUDE_RE.match(line)
            if m is None:
                out.append(line)
            else:
                if m.group(1) not in inlined:
                    out.append(expand(path.parent / m.group(1), inlined))
                out.append(f'#line {number + 1} "metal/{path.name}"')
        return "\n".join(out)

    families = []
    for s in sorted(sources):
        inlined: set[str] = set()
        source = expand(header, inlined) + "\n" + expand(s, inlined)
        if ')LILYMSL"' in source:
            raise RewriteError(f"{s}: kernel source contains the raw-string delimiter )LILYMSL\"")
        families.append((s.stem, f"metal/{s.name}", source, msl_rules.BASE_METAL_VERSION))
        if msl_rules.uses_tensor_ops(s.read_text()):
            families.append((f"{s.stem}.tensor_ops", f"metal/{s.name}", source, msl_rules.TENSOR_OPS_METAL_VERSION))
    rows = "\n".join(f'  {{"{name}", "{file}", R"LILYMSL({source})LILYMSL", {version}, '
                     f'"{" ".join(sorted(set(host_names(source))))}"}},'
                     for name, file, source, version in families)
    out.write_text(
        "// Generated by tools/msl2cpu.py: the Metal kernel libraries compiled at run time on Apple GPUs.\n"
        '#include "kernel_family.h"\n'
        f"extern const lily::EmbeddedKernelFamily lily_kernel_families[{len(families)}];\n"
        f"const lily::EmbeddedKernelFamily lily_kernel_families[{len(families)}] = {{\n{rows}\n}};\n"
        f"extern const unsigned lily_kernel_family_count;\nconst unsigned lily_kernel_family_count = {len(families)};\n"
        "extern const unsigned lily_base_metal_version;\n"
        f"const unsigned lily_base_metal_version = {msl_rules.BASE_METAL_VERSION};\n"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embed", nargs="+", metavar="PATH", help="OUT.cpp LILY_H SOURCES...")
    parser.add_argument("source", nargs="?", type=Path)
    parser.add_argument("out_dir", nargs="?", type=Path)
    parser.add_argument("--test-registry", action="store_true", help="register as harness self-test kernels")
    parser.add_argument("--metal-version", type=int, default=msl_rules.BASE_METAL_VERSION,
                        help="the __METAL_VERSION__ the file is compiled for (default %(default)s)")
    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: C++ for the CPU harness; cuda: CUDA for clang (OUT_DIR/<stem>.cu)")
    args = parser.parse_args(argv)
    try:
        if args.embed:
            embed(Path(args.embed[0]), Path(args.embed[1]), [Path(p) for p in args.embed[2:]])
        else:
            if args.source is None or args.out_dir is None:
                parser.error("SOURCE and OUT_DIR are required")
            args.out_dir.mkdir(parents=True, exist_ok=True)
            if args.target == "cuda":
                msl_rules.check_file(args.source, args.metal_version)
                generate_cuda(args.source, args.out_dir)
            else:
                generate(args.source, args.out_dir, args.test_registry, args.metal_version)
    except (RewriteError, msl_rules.RuleViolation) as e:
        print(f"msl2cpu: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
