#!/bin/bash
# Issue 21, 2026-12-05 sixth session, call 7: Nsight Compute on the sampler's block path (sample_partial_f32,
# sample_final_f32; bench_kernels' cases for T 0.7 with top-k 50 and top-p 0.9, and plain T 0.7; one cold launch each):
# speed of light, warp states with stall reasons, occupancy, launch statistics and the source counters (where the
# warps stall, by SASS line). The kernels of 1ab0eb6 (.dev/c8's PTX).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
(cd .dev/c8 && tar xJf full.tar.xz)
export LILY_CUDA_PTX_DIR=$PWD/.dev/c8/full
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF . > /tmp/install.log 2>&1; t "install rc=$?"
NCU=/usr/local/cuda/bin/ncu
STALLS=smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.max
timeout 200 $NCU --kernel-name regex:"sample_(partial|final)" --launch-count 4 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters \
  --section InstructionStats --metrics $STALLS \
  python3 scripts/bench_kernels.py --repeats 1 --kernels 'sample block path' > $OUT/ncu_sample.txt 2>&1; t "ncu rc=$?"
grep -E "^  [a-z_0-9]+ \(|Duration|Registers Per|Achieved Active Warps|Warp Cycles Per Issued|stalled|inst_executed|cycles_elapsed" $OUT/ncu_sample.txt | sed 's/  */ /g' | head -100
t done
