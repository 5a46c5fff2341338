#!/bin/bash
# Issue 21, 2026-12-05 fifth session, call 5: short prompts through the engine (lily bench -p 1,2,4,8 -n 4 -r 7): qmv_mma
# with the engine's simdgroups by output count (s8: 8 below 8192 outputs), all at 4 (s4: LILY_EXP_QMV_MMA_SG=4, an
# uncommitted host override for this call only), and MMA_GEMV off; alternating, twice each; medians per test.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
root=$PWD; C=$root/.dev/c4
(cd $C && tar xJf full.tar.xz && cp qmatmul.ptx full/)
export LILY_CUDA_PTX_DIR=$C/full
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 $C/jitwarm.py -j 8 $C/full/*.ptx > /dev/null 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.LILY_CUDA_KERNELS=OFF . > /dev/null 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
mkdir -p /tmp/pp
for v in s8 s4 off s8 s4 off; do
  unset LILY_DISABLE_MMA_GEMV LILY_EXP_QMV_MMA_SG
  [ $v = off ] && export LILY_DISABLE_MMA_GEMV=1
  [ $v = s4 ] && export LILY_EXP_QMV_MMA_SG=4
  timeout 100 lily bench --dummy-weights --full-size --backend cuda -p 1,2,4,8 -n 4 -d 0 -r 7 --no-expert-load -o json > /tmp/pp/$v.$RANDOM.json 2>/dev/null; t "pp $v rc=$?"
done
cd /tmp/pp && tar czf $OUT/pp_json.tar.gz *.json
python3 - > $OUT/pp_medians.txt <<'PY'
import glob, json, statistics, collections
rows = collections.defaultdict(list)
for f in sorted(glob.glob("/tmp/pp/*.json")):
    v = f.split("/")[-1].split(".")[0]
    for r in json.load(open(f)):
        rows[(r["test"], v)].append(statistics.median(r["samples_ts"]))
print("median prompt tok/s of 7 samples, per process (two processes per variant)")
for test in ("pp1", "pp2", "pp4", "pp8"):
    print(test, "  ".join(f"{v} " + "/".join(f"{x:.1f}" for x in rows[(test, v)]) for v in ("s8", "s4", "off")))
PY
cat $OUT/pp_medians.txt
t done
