"""Sampled decode without top-k beside greedy and the bar's sampled mode, one process (fifteenth session):
tg64 on the full-size dummy model, medians of 3 rounds after a warm-up, each mode prefilled afresh."""
import statistics, sys, time, json
import numpy as np
from lily import Model
from lily.bench import GREEDY_DECODE, SAMPLED_DECODE
MODES = {"greedy": GREEDY_DECODE, "sampled (T 0.7, top-k 50, top-p 0.9)": SAMPLED_DECODE,
         "nucleus (T 0.7, top-k 0, top-p 0.9)": dict(SAMPLED_DECODE, top_k=0),
         "min-p (T 0.7, top-k 0, top-p 1, min-p 0.05)": dict(SAMPLED_DECODE, top_k=0, top_p=1.0, min_p=0.05)}
model = Model.load("full-size", load_format="dummy", backend="cuda", progress=False)
prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 64).tolist()
rates = {m: [] for m in MODES}
for r in range(4):
    for mode, opts in MODES.items():
        s = model.prefill(prompt, use_cache=False)
        t = time.perf_counter(); n = sum(1 for _ in s.decode(max_tokens=64, stop_token_ids=(), **opts))
        if r: rates[mode].append(n / (time.perf_counter() - t))
        if r == 3: print(mode, "kernels:", sorted(k for k in model.backend.last_step_counts()["dispatches_by_kernel"] if k.startswith(("sample", "argmax"))), flush=True)
for mode, v in rates.items():
    print(f"{mode}: median {statistics.median(v):.1f} tok/s ({', '.join(f'{x:.1f}' for x in v)})", flush=True)
json.dump(rates, open(sys.argv[1], "w"), indent=1)
