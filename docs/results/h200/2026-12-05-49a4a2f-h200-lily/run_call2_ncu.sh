#!/bin/bash
# Seventh session, call 2: Nsight Compute on decode attention (the kernels of 49a4a2f, .dev/d6's PTX): the 64-key
# single pass on matrix units, its prep, and at 4K keys the partials with and without the prep fused in (the fused
# kernel takes 7 us more than the partials alone, cold): speed of light, warp states with stall reasons, occupancy,
# launch statistics, source counters (where the warps stall, by SASS line).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
(cd .dev/d6 && tar xJf full.tar.xz)
export LILY_CUDA_PTX_DIR=$PWD/.dev/d6/full
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 .dev/e2/jitwarm.py -j 6 $LILY_CUDA_PTX_DIR/attention*.ptx > $OUT/jitwarm.txt 2>&1 &
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF . > /tmp/install.log 2>&1; t "install rc=$?"
wait
NCU=/usr/local/cuda/bin/ncu
STALLS=smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.max,gpu__time_duration.sum
timeout 240 $NCU --kernel-name regex:"attention_(prep|decode_mma|decode_partial_mma|decode_partial_prep_mma)_bf16_d256" \
  --launch-count 8 --cache-control all --clock-control base \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters \
  --section InstructionStats --section MemoryWorkloadAnalysis --metrics $STALLS \
  python3 scripts/bench_kernels.py --repeats 1 --kernels 'attention decode (64|4K) keys' > $OUT/ncu_attention.txt 2>&1; t "ncu rc=$?"
grep -E "^  [a-z_0-9]+ \(|Duration|Registers Per|Achieved Active Warps|Warp Cycles Per Issued|stalled_(long|barrier|short|wait|math|no_inst|branch)|inst_executed|cycles_elapsed" $OUT/ncu_attention.txt | sed 's/  */ /g' | head -120
t done
