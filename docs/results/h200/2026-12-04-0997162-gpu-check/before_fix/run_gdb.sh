#!/bin/bash
export PYTHONUNBUFFERED=1
(cd .dev && tar xJf ptx.tar.xz)
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF -Ccmake.define.LILY_TEST_BUILD=ON -Ccmake.build-type=RelWithDebInfo . > $OUT/build.txt 2>&1; echo "install rc=$?"
export LILY_CUDA_PTX_DIR=$PWD/.dev/ptx LILY_CUDA_TESTS=gpu HF_HUB_OFFLINE=1
root=$PWD; cd /tmp
timeout 200 /usr/local/cuda/bin/cuda-gdb -batch -ex run -ex bt --args python3 -m pytest -q -p no:cacheprovider --rootdir "$root" "$root/tests/test_cuda_driver.py" -k refused > $OUT/gdb.txt 2>&1; echo "gdb rc=$?"
grep -n "^#" $OUT/gdb.txt | head -40
python3 -c "import sys; print(sys.version)"; ldd $(python3 -c "import lily._ext as e; print(e.__file__)") | grep -i "stdc\|gcc"
python3 - <<'PY'
import lily._ext as e, ctypes
print(e.__file__)
PY
grep -m3 "libstdc" /proc/self/maps
