#!/bin/bash
# Issue 21, twelfth session, call 3 on the warm machine ($1: seconds it may take): the peer run of the tree of cb3acd3
# with its PTX (call 2's): lily bench -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3, then run.sh's gguf bandwidth plan
# llama sampled table stages (REPS=3; llama.cpp built by call 2). Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-560}
root=$PWD; P=/tmp/p10/main; R=/tmp/r10/call3; rm -rf $R; mkdir -p $R
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
export PEER_OUT=/tmp/lily-peer/out
finish() { mkdir -p $R/peer; cp $PEER_OUT/*.json $PEER_OUT/*.md $PEER_OUT/*.log $PEER_OUT/*.txt $PEER_OUT/llama.cpp.commit $R/peer/ 2>/dev/null; cp /tmp/lily-peer/build_stage.log $R/peer/ 2>/dev/null; tar czf $OUT/call3.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt; cat $R/device.txt
export LILY_CUDA_PTX_DIR=$P; ls $P | wc -l
timeout $(left 150) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
grep -E "^\s+(tg|pp)" $PEER_OUT/lily-bench.log
OUT=$PEER_OUT REPS=3 timeout $(left 5) bash scripts/peer_bench/run.sh build gguf bandwidth plan llama sampled table 2>&1 | tail -24; t "peer stages done"
t done
