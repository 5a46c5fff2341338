"""A pytest plugin (``-p as_mac_build``, with tests/ on sys.path) that makes ``lily._ext`` look like a Mac build before
the tests are collected: Metal is the platform, the MSL CPU harness (``lily._ext.msl``) cannot be imported and the
fake Metal's controls are gone. tests/test_collection.py runs the suite under it (docs/verification.md)."""

import sys

from lily import _ext

_ext.platform = "metal"
if hasattr(_ext, "msl"):
    del _ext.msl
sys.modules.pop("lily._ext.msl", None)  # `from lily._ext import msl` raises ImportError, as on a Mac
for _name in ("set_stage_order", "fake_stats", "reset_fake_stats", "live_objects"):
    if hasattr(_ext._test_engine, _name):
        delattr(_ext._test_engine, _name)
