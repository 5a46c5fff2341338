#!/bin/bash
# call 2 on the warm machine: call 1's A/B split in two processes (four full-size models fill 80 GB):
# A: base all128 all96 base2; B: base moe128 qmv128 attn128. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); P=/tmp/ptx22; R=/tmp/r22/call2; rm -rf $R; mkdir -p $R
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
trap 'tar czf $OUT/call2.tar.gz -C $R .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
timeout 280 python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  base=$P/cur all128=$P/all128 all96=$P/all96 base2=$P/cur 2>&1 | grep -v Warning > $R/ab_a.txt
t "A/B a rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_a.txt | grep -v "between\|timeline"
timeout 280 python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  base=$P/cur moe128=$P/moe128 qmv128=$P/qmv128 attn128=$P/attn128 2>&1 | grep -v Warning > $R/ab_b.txt
t "A/B b rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_b.txt | grep -v "between\|timeline"
t done
