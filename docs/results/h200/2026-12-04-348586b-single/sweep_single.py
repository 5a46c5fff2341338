"""Sweep (experiment): attention_decode_mma (the single pass) and the vector single pass at 64 and 200 keys; the mma
kernel over 2, 4 and 8 simdgroups, timed by scripts/bench_kernels.py's run()."""
import argparse, dataclasses, importlib.util, json, struct, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bk", ROOT / "scripts/bench_kernels.py")
bk = importlib.util.module_from_spec(spec); sys.modules["bk"] = bk; spec.loader.exec_module(bk)
out = Path(sys.argv[1]); results = []
for sg in (2, 4, 8):
    bk.ATTN_DECODE_MMA_SINGLE_SIMDGROUPS = sg
    base = [c for c in bk.cases() if c.label.startswith("attention decode 64 keys: single pass")]
    sel = list(base)
    for keys in (200,):
        for c in base:
            args = struct.pack("<7If", 1, bk.ATTN_HEADS, bk.ATTN_KV_HEADS, keys, keys, 0, 0, bk.HEAD_DIM ** -0.5)
            cache = bk.ATTN_KV_HEADS * keys * bk.HEAD_DIM * 2
            buffers = [args, c.buffers[1], c.buffers[2], cache, cache, c.buffers[5]]
            sel.append(dataclasses.replace(c, label=c.label.replace("64 keys", f"{keys} keys"), buffers=buffers))
    if sg != 8:
        sel = [c for c in sel if "matrix units" in c.label]
    rows = bk.run(argparse.Namespace(repeats=20), sel)
    for r in rows:
        r["variant"] = f"single simdgroups={sg}"
        print(f"{r['variant']:24s} {r['case']:60s} {r['us']:8.1f} {r.get('us_warm', '')}")
    results.extend(rows)
out.write_text(json.dumps(results, indent=1))
