"""Kernel test cases, defined once per op and run on every executor.

One module per op of docs/kernels.md (``lily.kernel_cases.<op>``, the name of ``metal/<op>.metal``) holds ``PATTERN``,
a regex matching the host names of its kernels, and ``cases(kernel)``, every case of one kernel: inputs from the
case's seeded generator, the float64 reference from ``lily.reference``, NaN-poisoned outputs, the tolerance and the
boundary shapes. The first case of each kernel is marked ``quick``: the self-test's default set.

Two runners use them: ``tests/kernels/test_<op>.py`` parametrizes over every case of its op, and
``python -m lily.selftest`` runs the quick cases (or all, with ``--all``) and prints the table. Either runs the
cases on a device of ``lily.selftest.device``: the CPU harness, the Metal API (a Mac's GPU) or CUDA. This package
ships with Lily, so the self-test runs on a user's machine without the tests/ directory.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType

from lily.kernel_cases.common import Case, Outcome, Run, Tolerance

__all__ = ["OPS", "Case", "Outcome", "Run", "Tolerance", "cases", "op_module", "op_of"]

# The ops of docs/kernels.md, each a module of this package.
OPS = ("attention", "attention_prefill", "attention_prep", "dequantize", "embedding", "gated_delta",
       "gated_delta_prefill", "mm", "moe", "moe_prefill", "qmatmul", "rms_norm", "sampling")


def op_module(op: str) -> ModuleType:
    """The case module of `op`."""
    if op not in OPS:
        raise ValueError(f"kernel_cases: no op named {op!r}; ops are {', '.join(OPS)}")
    return importlib.import_module(f"{__name__}.{op}")


def op_of(kernel: str) -> str | None:
    """The op whose ``PATTERN`` matches the whole host name, or None."""
    for op in OPS:
        if op_module(op).PATTERN.fullmatch(kernel):
            return op
    return None


def cases(kernels: Iterable[str], op: str | None = None, quick: bool = False) -> list[Case]:
    """The cases of `kernels` (in their order) that belong to `op` (default: any op); only the quick ones with
    `quick`. A kernel of no op has no case."""
    found = []
    for kernel in kernels:
        owner = op_of(kernel)
        if owner is None or (op is not None and owner != op):
            continue
        found += [c for c in op_module(owner).cases(kernel) if c.quick or not quick]
    return found
