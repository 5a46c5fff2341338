"""Lily: fast local inference of Qwen3.5/3.6-35B-A3B.

>>> import lily
>>> model = lily.Model.load("lily:demo")
>>> print(model.generate("ROMEO:", max_tokens=32, temperature=0).text)
"""

from importlib.metadata import PackageNotFoundError, version

from lily.model import Cancelled, Model, Result, Session, Stats, Token
from lily.snapshot import Snapshot

try:
    __version__ = version("lily")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "unknown"

__all__ = ["Model", "Session", "Token", "Result", "Stats", "Snapshot", "Cancelled", "__version__"]
