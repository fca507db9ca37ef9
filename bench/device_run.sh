#!/usr/bin/env bash
# One call on the GPU machine: kernel benchmarks, a short tune, and an end-to-end decode bench.
# Usage there: bash bench/device_run.sh   (needs .whl carried; writes everything under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 KILNX_CACHE_DIR=/tmp/kilnx-cache KILNX_DB=sqlite:////tmp/kilnx-tune.db
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
timeout 260 python3 bench/bench_kernels.py --suite quant --out $OUT 2>&1 | tee $OUT/quant.log | grep -v "^  " | tail -60
timeout 150 python3 bench/bench_kernels.py --suite fusions --out $OUT 2>&1 | tee $OUT/fusions.log | grep -v "^  " | tail -45
timeout 90 python3 -m kilnx.cli bench --model llama-3.2-1b --random --prompt-lens 128 --gen 64 --device cuda \
  --csv $OUT/e2e.csv 2>&1 | tail -15
timeout 120 python3 -m kilnx.cli tune --device sm_90 --model llama-3.1-8b --kernel qmv --budget 100s --workers 1 2>&1 | tail -40
python3 -m kilnx.cli db export $OUT/tune.json 2>&1 | tail -2
ls -la $OUT
