"""Snapshots of a session and the prompt cache that keeps them; a backend state described as JSON plus arrays, for
``Session.save``/``Session.load``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Snapshot:
    """A frozen copy of a session: its state, its tokens and the logits of its last position."""

    state: Any
    token_ids: tuple[int, ...]
    last_logits: np.ndarray | None
    fingerprint: str

    @property
    def nbytes(self) -> int:
        """Bytes held by the state arrays and the logits."""
        held = _nbytes(self.state)
        return held + (self.last_logits.nbytes if self.last_logits is not None else 0)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(x) for x in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(_nbytes(x) for x in vars(obj).values())
    return 0


class PromptCache:
    """Snapshots keyed by token prefixes, bounded in count and bytes, evicted least recently used."""

    def __init__(self, max_entries: int = 16, max_bytes: int = 4 << 30) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("prompt cache limits must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held by every stored snapshot."""
        return sum(s.nbytes for s in self._entries.values())

    def keys(self) -> list[tuple[int, ...]]:
        """Token prefixes currently cached, least recently used first."""
        return list(self._entries)

    def insert(self, snapshot: Snapshot) -> None:
        """Store a snapshot (replacing one with the same tokens), then evict down to the bounds."""
        if self.max_entries == 0 or snapshot.nbytes > self.max_bytes or not snapshot.token_ids:
            return
        with self._lock:
            self._entries.pop(snapshot.token_ids, None)
            self._entries[snapshot.token_ids] = snapshot
            total = self.nbytes
            while len(self._entries) > self.max_entries or total > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                total -= dropped.nbytes

    def longest_prefix(self, token_ids: Sequence[int]) -> Snapshot | None:
        """The snapshot with the most tokens that are a prefix of ``token_ids`` (marked as used)."""
        ids = tuple(token_ids)
        with self._lock:
            best = None
            for key, snap in self._entries.items():
                if len(key) <= len(ids) and (best is None or len(key) > len(best.token_ids)):
                    if ids[: len(key)] == key:
                        best = snap
            if best is not None:
                self._entries.move_to_end(best.token_ids)
            return best

    def clear(self) -> None:
        """Drop every snapshot."""
        with self._lock:
            self._entries.clear()


def flatten_state(obj: Any, name: str, tensors: dict[str, np.ndarray]) -> Any:
    """Describe a backend state as JSON, moving every array into ``tensors`` under a path name."""
    if isinstance(obj, np.ndarray):
        tensors[name] = obj
        return {"tensor": name}
    if isinstance(obj, (list, tuple)):
        return {"list": [flatten_state(x, f"{name}.{i}", tensors) for i, x in enumerate(obj)]}
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return {"value": obj}
    if isinstance(obj, (np.integer, np.floating)):
        return {"value": obj.item()}
    if hasattr(obj, "__dict__"):
        return {"object": type(obj).__name__,
                "fields": {k: flatten_state(v, f"{name}.{k}", tensors) for k, v in vars(obj).items()}}
    raise TypeError(f"cannot save a state field of type {type(obj).__name__} at {name}")


def unflatten_state(template: Any, node: Any, tensors: Mapping[str, np.ndarray]) -> Any:
    """Rebuild a state like ``template`` (from the backend's new_state) from a saved description."""
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "value" in node:
        return node["value"]
    if "list" in node:
        if not isinstance(template, (list, tuple)) or len(template) != len(node["list"]):
            raise ValueError("layer count differs")
        items = [unflatten_state(t, n, tensors) for t, n in zip(template, node["list"])]
        return type(template)(items)
    if node.get("object") != type(template).__name__:
        raise ValueError(f"state part {node.get('object')} where {type(template).__name__} was expected")
    for key, child in node["fields"].items():
        setattr(template, key, unflatten_state(getattr(template, key), child, tensors))
    return template
