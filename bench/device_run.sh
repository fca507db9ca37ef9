#!/usr/bin/env bash
# GPU-machine driver: bash bench/device_run.sh STEP...   (needs .whl carried; everything lands in $OUT)
# Steps: gputests gpuquick (TESTS=files GPUQUICK_SECS) swiglu (SWIGLU_ROUNDS) e2eab (AB_MODELS="8b 1b moe" AB_VAR=KILNX_PDL|KILNX_PREPARED_LAUNCH|KILNX_WG|KILNX_FUSED_SWIGLU|KILNX_FUSED_QKV_ROPE|KILNX_FUSED_ROPE|KILNX_DECODE_LOOKAHEAD|KILNX_MOE_PREPARED AB_VALUES="1 0" AB_PROMPTS=128,2048) quant qmv tc qmm ncu fusions moe e2e1b e2e8b (E2E_CSV=name) tune (TUNE_MODEL) tune8b tunewg cold8b moeprobe (MOEPROBE_ROUNDS) tcgemv tcqmm attnprobe attnwarps attnmerge batchdecode (BATCH_MODEL BATCH_SIZES BATCH_STEPS) batchbench (BATCH_SIZES="1 4 8 16" BATCH_MODEL) serveload (SERVE_MODEL SERVE_BATCHES SERVE_REQUESTS) serveconv (SERVE_CONVERSATIONS) speculative (SPEC_MODEL SPEC_ARGS) kvab (KV_MODEL KV_PROMPTS KV_ROUNDS) armsab (ARMS="name:VAR=V,VAR=V ..." ARMS_ROUNDS ARMS_MODEL ARMS_PROMPTS) attnkv mixed (MIXED_MODEL) hybrid (HYBRID_PROMPTS HYBRID_MODELS HYBRID_TEST_FILES) hybridpg (PG_VALUES HYBRID_MODELS HYBRID_PROMPTS) parked (PARKED_CONTEXTS PARKED_ROWS PARKED_HYBRID) treeab (TREE_OLD TREE_MODELS TREE_PROMPTS TREE_ROUNDS) ssmmixer ncuwg mmagemv (MMA_ROUNDS) qmmrows mmprefill (MMP_ROUNDS) splitk (SPLITK_SHAPES SPLITK_TILES SPLITK_SPLITS SPLITK_STAGES)   -- each has its own time limit and log.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 KILNX_CACHE_DIR=/tmp/kilnx-cache KILNX_DB=${KILNX_DB:-sqlite:////tmp/kilnx-tune.db}
# the commit column: pass KILNX_COMMIT=<hash> with the call, the hash written out in the command (a .commit file,
# ignored by git, came back stale from the device copy in session 15; `$(git rev-parse HEAD)` evaluated there gave an
# older commit than the tree it ran in session 28)
export KILNX_COMMIT=${KILNX_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
# bytecode caches somewhere writable, as any installed Python has them: without, every new process compiled
# torch's and sqlalchemy's sources again (cProfile of a cold start: 4.2 s in builtins.compile)
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pycache
env | grep -i "^python" > $OUT/python_env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
step() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout $secs "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; grep -v "^  " $OUT/$name.log | tail -${TAIL:-25}
}
for s in "$@"; do case $s in
  gputests) step gputests 240 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_qkv_rope.py tests/dsl/test_pdl.py tests/kernels/test_prepared.py tests/kernels/test_qmatmul_gpu.py tests/dsl/test_half2.py tests/runtime/test_engine_gpu.py tests/tuner/test_tuner_gpu.py ;;
  gpuquick) step gpuquick ${GPUQUICK_SECS:-200} python3 -m pytest -m gpu -q -x -p no:cacheprovider ${TESTS:-tests/kernels/test_qkv_rope.py} ;;
  quant) step quant 330 python3 bench/bench_kernels.py --suite quant --out $OUT ;;
  qmv) KILNX_BENCH_ONLY=qmv step qmv ${QMV_SECS:-400} python3 bench/bench_kernels.py --suite quant --out $OUT/qmv ;;
  gpuengine) step gpuengine 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_prepared.py tests/runtime/test_engine_gpu.py tests/tuner/test_tuner_gpu.py ;;
  fp4) KILNX_BENCH_ONLY=fp4 step fp4 90 python3 bench/bench_kernels.py --suite quant --out $OUT/fp4 ;;
  gateup) KILNX_BENCH_ONLY=gate_up step gateup 200 python3 bench/bench_kernels.py --suite quant --out $OUT/gateup ;;
  profprefill) step profprefill_${PROFILE_LEN:-2048} 120 python3 bench/profile_prefill.py ${PROFILE_LEN:-2048} ${PROFILE_MODEL:-llama-3.1-8b} ;;
  splitk) step splitk ${SPLITK_SECS:-500} python3 bench/probes/splitk_gemv.py $OUT/splitk_gemv.csv ;;
  swiglu) step swiglu ${SWIGLU_SECS:-300} python3 bench/probes/swiglu_prep.py $OUT/swiglu_prep.csv ${SWIGLU_ROUNDS:-2} ;;
  mmprefill) step mmprefill ${MMP_SECS:-300} python3 bench/probes/mm_prefill.py $OUT/mm_prefill.csv ${MMP_ROUNDS:-3} ;;
  mmagemv) step mmagemv ${MMA_SECS:-330} python3 bench/probes/mma_gemv.py $OUT/mma_gemv.csv ${MMA_ROUNDS:-1} ;;
  qmmrows) step qmmrows ${QMMROWS_SECS:-400} python3 bench/probes/qmm_rows.py $OUT/qmm_rows.csv ${QMMROWS_ROUNDS:-2} ;;
  mixed) step mixed ${MIXED_SECS:-300} python3 bench/probes/mixed_step.py $OUT/mixed_step.csv ${MIXED_MODEL:-llama-3.1-8b} --random ;;
  attnkv) step attnkv ${ATTN_SECS:-200} python3 bench/probes/attention_decode.py $OUT/attention_kv.csv kv ;;
  attnprobe) step attnprobe ${ATTN_SECS:-300} python3 bench/probes/attention_decode.py $OUT/attention_decode.csv ;;
  attnwarps) step attnwarps ${ATTN_SECS:-150} python3 bench/probes/attention_decode.py $OUT/attention_warps.csv warps ;;
  attnmerge) step attnmerge ${ATTN_SECS:-150} python3 bench/probes/attention_decode.py $OUT/attention_merge.csv merge ;;
  profdecode) step profdecode 120 python3 bench/profile_decode.py ${PROFILE_MODEL:-llama-3.1-8b} ${PROFILE_ARGS:-} ;;
  profsplit) for a in "128 2113" "2048 2113"; do for sp in 1 0; do
               echo "== profile prompt/cache $a split=$sp"; KILNX_ATTENTION_SPLIT=$sp timeout 100 python3 bench/profile_decode.py llama-3.1-8b $a 2>&1 \
               | grep -E "decode after|attention|qmv_h2 |rope|Self CUDA time total"; done; done > $OUT/profsplit.log 2>&1; cat $OUT/profsplit.log ;;
  ncu) step ncu 240 ncu --clock-control none --set detailed --section WarpStateStats --section SchedulerStats \
         -k regex:${NCU_KERNEL:-qmv} --launch-skip ${NCU_SKIP:-4} --launch-count ${NCU_COUNT:-2} \
         python3 bench/profile_qmv.py "${PROFILE_CONFIGS:-{\}}" ;;
  ncuwg) step ncuwg 240 ncu --clock-control none --set detailed --section WarpStateStats --section SchedulerStats \
           -k regex:qmm_wg --launch-skip 12 --launch-count 4 python3 bench/profile_wg.py ;;
  tc) KILNX_BENCH_ONLY=qmv H2_STAGES=3 QMV_PATHS=qmv_h2,qmv_tc QMV_H2_MAX=0 QMV_SWEEP_ROWS=1 step tc ${TC_SECS:-420} python3 bench/bench_kernels.py --suite quant --out $OUT/tc ;;
  qmm) KILNX_BENCH_ONLY=qmm step qmm ${QMM_SECS:-200} python3 bench/bench_kernels.py --suite quant --out $OUT/qmm ;;
  cold8b) python3 bench/cold_first_token.py --model llama-3.1-8b > $OUT/cold_warmup.log 2>&1
          step cold8b 120 python3 bench/cold_first_token.py --model llama-3.1-8b --csv $OUT/cold.csv
          step cold8b_profile 120 python3 bench/cold_first_token.py --model llama-3.1-8b --profile $OUT/cold_profile.txt
          KILNX_LAZY_GRAPHS=1 step cold8b_lazy 120 python3 bench/cold_first_token.py --model llama-3.1-8b --csv $OUT/cold_lazy.csv ;;
  coldrep) python3 bench/cold_first_token.py --model ${COLD_MODEL:-llama-3.1-8b} > $OUT/cold_warmup.log 2>&1   # fills the caches
           for i in $(seq ${COLD_RUNS:-5}); do python3 bench/cold_first_token.py --model ${COLD_MODEL:-llama-3.1-8b} \
             --csv $OUT/cold_run$i.csv 2>&1 | tail -1; done ;;
  tcqmm) step tcqmm ${TCQMM_SECS:-400} python3 bench/probes/tc_qmm.py $OUT/tc_qmm.csv ;;
  tcgemv) step tcgemv ${TCGEMV_SECS:-400} python3 bench/probes/tc_gemv.py $OUT/tc_gemv.csv ;;
  batchbench) for b in ${BATCH_SIZES:-1 4 8 16}; do for v in on 0; do   # kilnx bench --batch, the wgmma route on / off
                KILNX_WG=$([ $v = 0 ] && echo 0) step e2e_b${b}_wg$v 240 python3 -m kilnx.cli bench --model ${BATCH_MODEL:-llama-3.1-8b} --random --prompt-lens 128 --gen 64 --repeats 2 --batch $b --device cuda --csv $OUT/e2e_batch_wg$v.csv; done; done ;;
  serveload) for la in 1 0; do   # the scheduler with its GPU lookahead on / off
               KILNX_SERVE_LOOKAHEAD=$la step serveload_la$la ${SERVE_SECS:-240} python3 bench/probes/serve_load.py $OUT/serve_load_la$la.csv ${SERVE_MODEL:-llama-3.1-8b} ${SERVE_BATCHES:-1,4,8,16} ${SERVE_REQUESTS:-16} 64 --random; done ;;
  speculative) step speculative ${SPEC_SECS:-200} python3 bench/probes/speculative.py $OUT/speculative.csv ${SPEC_MODEL:-llama-3.1-8b} --random ${SPEC_ARGS:---draft llama-3.2-1b} ;;
  serveconv) step serveconv ${SERVE_SECS:-240} python3 bench/probes/serve_load.py $OUT/serve_conv.csv ${SERVE_MODEL:-llama-3.1-8b} --conversations ${SERVE_CONVERSATIONS:-6} --random ;;
  batchdecode) step batchdecode ${BATCH_SECS:-330} python3 bench/probes/batch_decode.py $OUT/batch_decode.csv ${BATCH_MODEL:-llama-3.1-8b} ${BATCH_SIZES:-1,2,4,8,16} ${BATCH_STEPS:-64} ${BATCH_SETTINGS:-default,direct,off} ;;
  moeprobe) step moeprobe ${MOEPROBE_SECS:-300} python3 bench/probes/moe_onepass.py $OUT/moe_onepass.csv ${MOEPROBE_ROUNDS:-2} ;;
  fusions) step fusions 150 python3 bench/bench_kernels.py --suite fusions --quick --out $OUT ;;
  moe) KILNX_MOE_CASES=${MOE_CASES:-all} step moe ${MOE_SECS:-200} python3 bench/bench_kernels.py --suite moe --out $OUT ;;
  e2e1b) step e2e1b 120 python3 -m kilnx.cli bench --model llama-3.2-1b --random --prompt-lens 128 --gen 64 --device cuda --csv $OUT/${E2E_CSV:-e2e}.csv ;;
  e2eab) for v in $(for i in $(seq ${AB_ROUNDS:-2}); do echo ${AB_VALUES:-1 0}; done); do export ${AB_VAR:-KILNX_PDL}=$v   # A/B of a switch, twice, in one process image
          case "${AB_MODELS:-8b 1b}" in *8b*) step e2e8b_${AB_VAR:-KILNX_PDL}$v 200 python3 -m kilnx.cli bench --model llama-3.1-8b --random --prompt-lens ${AB_PROMPTS:-128,2048} --gen 64 --device cuda --csv $OUT/e2e_ab$v.csv ;; esac
          case "${AB_MODELS:-8b 1b}" in *1b*) step e2e1b_${AB_VAR:-KILNX_PDL}$v 120 python3 -m kilnx.cli bench --model llama-3.2-1b --random --prompt-lens 128 --gen 64 --device cuda --csv $OUT/e2e_ab$v.csv ;; esac
          case "${AB_MODELS:-8b 1b}" in *moe*) step e2emoe_${AB_VAR:-KILNX_PDL}$v 200 python3 -m kilnx.cli bench --model ${MOE_MODEL:-qwen3-30b-a3b} --random --prompt-lens 128 --gen 64 --device cuda --csv $OUT/e2e_ab$v.csv ;; esac
          done; unset ${AB_VAR:-KILNX_PDL} ;;
  armsab) for r in $(seq ${ARMS_ROUNDS:-2}); do for arm in ${ARMS:-on: off:KILNX_FUSED_SWIGLU=0}; do   # arms NAME:VAR=V,VAR=V alternated
          name=${arm%%:*}; sets=${arm#*:}
          step e2e_arm_${name}_$r ${ARMS_SECS:-100} env $(echo $sets | tr , ' ') python3 -m kilnx.cli bench --model ${ARMS_MODEL:-llama-3.1-8b} --random --prompt-lens ${ARMS_PROMPTS:-128} --gen 64 --device cuda --csv $OUT/e2e_arm_$name.csv
          done; done
          # one CSV with an arm column, the steps' logs dropped (their tails are printed): a call returns ~8 files
          for f in $OUT/e2e_arm_*.csv; do a=${f##*/e2e_arm_}; awk -v a="${a%.csv}" 'NR==1{print "arm," $0; next}{print a "," $0}' $f; done \
            | awk 'NR==1 || !/^arm,/' > $OUT/e2e_arms.csv && rm -f $OUT/e2e_arm_*.csv $OUT/e2e_arm_*.log ;;
  kvab) for r in $(seq ${KV_ROUNDS:-2}); do for kv in fp8 auto; do   # the KV cache's dtype, alternated (twice) in one process image
          step e2e_kv${kv}_$r ${KV_SECS:-200} python3 -m kilnx.cli bench --model ${KV_MODEL:-llama-3.1-8b} --random --prompt-lens ${KV_PROMPTS:-128,2048,8192} --gen 64 --repeats 2 --device cuda --kv-cache-dtype $kv --csv $OUT/e2e_kv_$kv.csv; done; done ;;
  hybridpg) for v in ${PG_VALUES:-512 0}; do   # prefill graphs on / off (KILNX_PREFILL_GRAPH_MAX), short prompts
            for m in ${HYBRID_MODELS:-nemotron-3-nano-30b-a3b}; do KILNX_PREFILL_GRAPH_MAX=$v step e2e_${m}_pg$v ${HYBRID_SECS:-200} python3 -m kilnx.cli bench --model $m --random --prompt-lens ${HYBRID_PROMPTS:-128} --gen 32 --device cuda --csv $OUT/e2e_hybrid_pg$v.csv; done; done ;;
  treeab) root=$PWD; for r in $(seq ${TREE_ROUNDS:-2}); do for t in new old; do   # this tree against an older kilnx/ (TREE_OLD, carried; its commit TREE_OLD_COMMIT)
            tree=$([ $t = old ] && echo $root/${TREE_OLD:-.scratch/old} || echo $root); cd $tree   # python -m puts the cwd first on the path
            for m in ${TREE_MODELS:-llama-3.1-8b}; do PYTHONPATH=/tmp/site:$tree KILNX_COMMIT=$([ $t = old ] && echo ${TREE_OLD_COMMIT:-old} || echo $KILNX_COMMIT) step e2e_${m}_${t}_$r ${TREE_SECS:-150} python3 -m kilnx.cli bench --model $m --random --prompt-lens ${TREE_PROMPTS:-128,2048} --gen 64 --device cuda --csv $OUT/e2e_tree_$t.csv; done; cd $root; done; done ;;
  parked) step parked ${PARKED_SECS:-420} python3 bench/probes/parked_rows.py $OUT/parked_rows.csv ${PARKED_MODEL:-llama-3.1-8b} ${PARKED_CONTEXTS:-4096,32768} ${PARKED_ROWS:-5,8} 8 ${PARKED_STEPS:-64} ${PARKED_HYBRID:-nemotron-h-8b} ;;
  ssmmixer) step ssmmixer ${SSM_SECS:-200} python3 bench/probes/ssm_mixer.py $OUT/ssm_mixer.csv ;;
  hybrid) [ "${HYBRID_TESTS:-1}" = 0 ] || step hybrid_tests 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider ${HYBRID_TEST_FILES:-tests/models/test_hybrid.py}
          for m in ${HYBRID_MODELS:-nemotron-h-8b llama-3.1-8b}; do   # the hybrid and a peer of its size, in one run
            step e2e_$m ${HYBRID_SECS:-200} python3 -m kilnx.cli bench --model $m --random --prompt-lens ${HYBRID_PROMPTS:-128,2048} --gen 64 --device cuda --csv $OUT/e2e_hybrid.csv; done ;;
  e2emoe) step e2emoe ${MOE_E2E_SECS:-300} python3 -m kilnx.cli bench --model ${MOE_MODEL:-qwen3-30b-a3b} --random --prompt-lens 128,2048 --gen 64 --device cuda --csv $OUT/${E2E_CSV:-e2e}_moe.csv ;;
  e2e8b) step e2e8b 240 python3 -m kilnx.cli bench --model llama-3.1-8b --random --prompt-lens 128,2048 --gen 64 --device cuda --csv $OUT/${E2E_CSV:-e2e}.csv ;;
  tune) step tune_${TUNE_MODEL:-llama-3.2-1b} ${TUNE_SECS:-330} python3 -m kilnx.cli tune --device sm_90 --model ${TUNE_MODEL:-llama-3.2-1b} --budget ${TUNE_BUDGET:-290s} --workers 1 ${TUNE_ARGS:-} --csv $OUT/tune_${TUNE_MODEL:-llama-3.2-1b}.csv
        cp ${KILNX_DB#sqlite:///} $OUT/tune_${TUNE_MODEL:-llama-3.2-1b}.db 2>/dev/null ;;   # carried into a later call with KILNX_DB
  tunewg) step tunewg ${TUNE_SECS:-330} python3 -m kilnx.cli tune --device sm_90 --kernel qmm_wg --budget ${TUNE_BUDGET:-290s} --workers 1 --csv $OUT/tune_wg.csv ;;
  tune8b) step tune8b ${TUNE_SECS:-330} python3 -m kilnx.cli tune --device sm_90 --model llama-3.1-8b --budget ${TUNE_BUDGET:-290s} --workers 1 ${TUNE_ARGS:-} --csv $OUT/tune.csv
          python3 -m kilnx.cli db export $OUT/tune.json > /dev/null 2>&1; cp /tmp/kilnx-tune.db $OUT/ 2>/dev/null ;;
esac; done
# every CSV flat under $OUT with its step's folder in the name (files of one name in several folders did
# not all come back)
for f in $OUT/*/*.csv; do [ -f "$f" ] && mv "$f" "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"; done
ls $OUT
