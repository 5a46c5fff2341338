#!/bin/bash
# Issue 21, fifteenth session: on an H200, call.sh auto (checks, then the peer run); on another card, the quick check
# of the host's sample_final threads: build, lily.selftest --device cuda, the engine tests on the CUDA runtime and
# nucleus.py (sampled decodes without top-k) with the topp PTX set. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
root=$PWD; D=$root/.dev/d15
if nvidia-smi --query-gpu=name --format=csv | grep -q H200; then exec bash $D/call.sh auto ${1:-585} topp; fi
T0=$(date +%s); P=/tmp/p15; R=/tmp/r15/quick; rm -rf $R $P; mkdir -p $R $P
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
finish() { tar czf $OUT/quick.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/tree.txt $R/
tar xJf $D/topp.tar.xz -C $P; (cd $P && sha256sum *.ptx) > $R/ptx_sha256.txt
python3 $D/jitwarm.py -j 16 $P/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P
timeout 60 python3 $D/nucleus.py $R/nucleus.json > $R/nucleus.txt 2>&1; t "nucleus rc=$?"; grep -E "median|kernels" $R/nucleus.txt
timeout 60 python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1; t "selftest rc=$?"; tail -1 $R/selftest.txt
(cd /tmp && LILY_ENGINE_CHECKPOINTS=$root/.dev/h200/checkpoints LILY_ENGINE_RUNTIMES=cuda PYTHONPATH=$root \
  timeout 100 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/engine/test_metal_backend.py \
  $root/tests/engine/test_demo_metal.py $root/tests/engine/test_cuda_backend.py -k cuda > $R/engine_tests.txt 2>&1)
t "engine tests rc=$?"; tail -1 $R/engine_tests.txt
t done
