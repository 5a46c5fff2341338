"""Lily: fast local inference of Qwen3.5/3.6-35B-A3B.

>>> import lily
>>> model = lily.Model.load("lily:demo")
>>> print(model.generate("ROMEO:", max_tokens=32, temperature=0).text)
"""

from lily.model import Cancelled, Model, Result, Session, Token

__all__ = ["Model", "Session", "Token", "Result", "Cancelled"]
