#!/usr/bin/env bash
# The peer benchmark on the GPU machine: Lily (backend cuda, dummy weights) and llama.cpp's llama-bench (CUDA, Q4_0,
# flash attention on) on the same full-size Qwen3.6-35B-A3B shapes, in one run, then one table (table.py).
#
#   scripts/peer_bench/run.sh [STAGE ...]      stages: build gguf bandwidth plan llama lily sampled table (default: all)
#   (REPS and DEPTHS override the repetitions, 5, and the depths, 0,4096,32768; PROFILE the prompt length of the
#   per-kernel prefill profile at the end of lily-bench.log, 512)
#
# Needs .dev/peer/llama.cpp.tar.gz (scripts/peer_bench/prepare.py, run where there is network; carried to the GPU
# machine: it is git-ignored), gcc, nvcc, cmake, ninja, python3 with numpy and torch, and Lily installed with its
# CUDA backend (`lily bench --backend cuda`, issue 11). Each stage skips work already done (the build, the GGUF; a
# build cut short resumes), so a run can be split over several calls on a machine kept warm. Results go to $OUT
# (default $WORK/out); table.py refuses llama.cpp and Lily results measured over an hour apart.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$REPO/scripts/peer_bench"
WORK="${PEER_WORK:-/tmp/lily-peer}"
OUT="${OUT:-$WORK/out}"
JOBS="${JOBS:-$(nproc)}"
# Lily also measures the short prompts (pp1, pp8: a chat turn's first token), which llama-bench's table leaves out.
PROMPTS="512,4096"; LILY_PROMPTS="1,8,$PROMPTS"; GENS="128"; DEPTHS="${DEPTHS:-0,4096,32768}"; REPS="${REPS:-5}"
LLAMA="$WORK/llama.cpp"
MODEL="$WORK/qwen35moe-q4_0.gguf"
mkdir -p "$WORK" "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build gguf bandwidth plan llama lily sampled table)
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

for stage in "${stages[@]}"; do
  log "stage $stage"
  case "$stage" in
    build)
      # One build at a time: a second caller (a call made while an earlier one still builds in the background) waits
      # for it, where it would otherwise find no llama-bench yet and delete the tree under the running build.
      exec 9>"$WORK/build.lock"
      flock 9
      if [ ! -x "$LLAMA/build/bin/llama-bench" ]; then
        # A build cut short (its call ended) resumes: ninja keeps what it finished.
        [ -f "$LLAMA/.extracted" ] || { rm -rf "$LLAMA" && tar xzf "$REPO/.dev/peer/llama.cpp.tar.gz" -C "$WORK" &&
                                        touch "$LLAMA/.extracted"; }
        cmake -S "$LLAMA" -B "$LLAMA/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_NCCL=OFF >"$OUT/cmake.log"
        ninja -C "$LLAMA/build" -j "$JOBS" llama-bench >"$OUT/ninja.log"
      fi
      flock -u 9
      cp "$REPO/.dev/peer/llama.cpp.commit" "$OUT/" ;;
    gguf)
      [ -s "$MODEL" ] || python3 "$HERE/write_gguf.py" "$MODEL" --gguf-py "$LLAMA/gguf-py" | tee "$OUT/gguf.log" ;;
    bandwidth)
      python3 - "$OUT/bandwidth.json" <<'EOF'
import json, statistics, sys, torch
n = 1 << 30  # a 1 GiB device-to-device copy, as docs/performance.md's kernel table
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
times = []
for _ in range(20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); b.copy_(a); end.record(); end.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
json.dump({"bytes_per_second": 2 * n / statistics.median(times), "device": torch.cuda.get_device_name(),
           "how": "torch copy_ of 1 GiB, median of 20 after 3 warm-ups"}, open(sys.argv[1], "w"))
EOF
      cat "$OUT/bandwidth.json"; echo ;;
    plan)
      python3 - "$OUT/plan.json" "$DEPTHS" <<'EOF'
import json, sys
from lily.plan import full_size_args, plan_decode
depths = [int(d) for d in sys.argv[2].split(",")]
plan = {d: plan_decode(full_size_args(), context=d)["minimum_bytes"]["total"] for d in depths}
json.dump(plan, open(sys.argv[1], "w"))
EOF
      cat "$OUT/plan.json"; echo ;;
    llama)
      "$LLAMA/build/bin/llama-bench" -m "$MODEL" -p "$PROMPTS" -n "$GENS" -d "$DEPTHS" -ngl 99 -fa 1 -r "$REPS" \
        -o json >"$OUT/llama-bench.json" 2>"$OUT/llama-bench.log" ;;
    lily)
      # EXPERT_LOAD=0 skips the expert-load count (a cpu backend over the same weights, host time only)
      lily bench --dummy-weights --full-size --backend cuda -p "$LILY_PROMPTS" -n "$GENS" -d "$DEPTHS" -r "$REPS" \
        $([ "${EXPERT_LOAD:-1}" = 0 ] && echo --no-expert-load) --profile "${PROFILE:-512}" -o json \
        >"$OUT/lily-bench.json" 2>"$OUT/lily-bench.log" ;;
    sampled)
      # Lily's greedy against sampled decode (T 0.7, top-p 0.9, top-k 50), tg128, one process; table.py prints it
      python3 "$HERE/sampled.py" "$OUT/sampled.json" --tokens "$GENS" | tee "$OUT/sampled.txt" ;;
    table)
      python3 "$HERE/table.py" "$OUT" | tee "$OUT/table.md" ;;
    *)
      echo "unknown stage $stage (stages: build gguf bandwidth plan llama lily sampled table)" >&2; exit 2 ;;
  esac
done
