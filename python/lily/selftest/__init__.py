"""``python -m lily.selftest [--json] [--device {auto,metal-api,harness,cuda}] [--compile-only] [--kernels REGEX]
[--all]``: run every instantiated kernel against ``lily.reference``.

The cases are those of ``lily.kernel_cases``, the same definitions the kernel tests (tests/kernels/) parametrize
over: by default the representative (quick) case of each kernel, with ``--all`` every case. Each compares the
kernel's NaN-poisoned outputs with the float64 reference within the case's tolerance. The exit code is non-zero if
any case fails or if an instantiated kernel has no case.

``--device`` picks the executor (``lily.selftest.device``): ``metal-api`` through Lily's host Metal layer
(``lily._ext.kernels.Runner``), which on a Mac is the real GPU and on Linux the toy Objective-C runtime and fake Metal
executing on the CPU harness (docs/engine.md); ``harness`` straight through the Linux CPU execution harness
(``lily._ext.msl``, docs/harness.md; not built on macOS); ``cuda`` an NVIDIA GPU through the CUDA driver API
(``lily.cuda``, docs/cuda.md; ``--compile-only`` compiles every kernel for it and runs ptxas, with no GPU). ``auto``
(the default) is ``metal-api`` on a Mac and ``harness`` elsewhere.
"""

from lily.selftest.device import KernelDevice, open_device
from lily.selftest.runner import Result, main, run

__all__ = ["KernelDevice", "Result", "main", "open_device", "run"]
