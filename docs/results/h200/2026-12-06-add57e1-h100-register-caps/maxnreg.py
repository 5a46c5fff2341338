#!/usr/bin/env python3
"""Copy a PTX file with `.maxnreg N` added to named entries: python3 maxnreg.py IN OUT name=N ..."""
import re, sys
src, dst, caps = sys.argv[1], sys.argv[2], dict(a.split("=") for a in sys.argv[3:])
text = open(src).read()
for name, n in caps.items():
    pat = re.compile(r"(\.visible \.entry " + re.escape(name) + r"\((?:[^)]*)\)[^\n]*\n)\{", re.S)
    text, count = pat.subn(lambda m: m.group(1) + f".maxnreg {n}\n{{", text)
    assert count == 1, (name, count)
open(dst, "w").write(text)
