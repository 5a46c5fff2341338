#!/bin/bash
# Issue 21, eleventh session, call B on the warm machine ($1 seconds): the peer run of the working tree with the PTX
# call A's A/B chose (new where rope's median is at least blocks' at both depths, else cur: choice.txt): lily bench
# -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3, run.sh's gguf bandwidth plan llama sampled table stages (REPS=3),
# bench_kernels --json, a decode profile at depth 4096. Everything tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-560}
root=$PWD; D=$root/.dev/d8; P=/tmp/ptx23; R=/tmp/r23/call2; rm -rf $R; mkdir -p $R
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
export PEER_OUT=/tmp/lily-peer/out
finish() { mkdir -p $R/peer; cp $PEER_OUT/*.json $PEER_OUT/*.md $PEER_OUT/*.log $PEER_OUT/*.txt $PEER_OUT/llama.cpp.commit $R/peer/ 2>/dev/null; cp /tmp/lily-peer/build_stage.log $R/peer/ 2>/dev/null; tar czf $OUT/call2.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
choice=$(python3 - /tmp/r23/call1/ab.txt <<'PY'
import re, sys
ok, blocks = True, open(sys.argv[1]).read().split("== tg")[1:]
for block in blocks:
    med = dict((n, float(v)) for n, v in re.findall(r"^ +(base2|base|blocks|rope) +([0-9.]+)", block, re.M))
    ok = ok and len(med) == 4 and med["rope"] >= med["blocks"]
print("new" if ok and len(blocks) == 2 else "cur")
PY
)
echo $choice > $R/choice.txt; export LILY_CUDA_PTX_DIR=$P/$choice; t "peer run with $choice"
timeout $(left 200) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
grep -E "^\s+(tg|pp)" $PEER_OUT/lily-bench.log
while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && pgrep -f "ninja|cmake" > /dev/null && [ $(left) -gt 150 ]; do sleep 5; done
t "build: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"; tail -2 /tmp/lily-peer/build_stage.log
OUT=$PEER_OUT REPS=3 timeout $(left 75) bash scripts/peer_bench/run.sh build gguf bandwidth plan llama sampled table 2>&1 | tail -22; t "peer stages done"
[ $(left) -gt 40 ] && timeout $(left 35) python3 scripts/bench_kernels.py --repeats 20 --json $R/bench_kernels.json > $R/bench_kernels.txt 2>&1; t "bench_kernels rc=$?"
[ $(left) -gt 30 ] && timeout $(left 3) python3 $D/profile_kernels.py --prompt 8 --decode 32 --depth 4096 2>&1 | grep -v Warning > $R/profile_d4096.txt; t "profile rc=$?"
t done
