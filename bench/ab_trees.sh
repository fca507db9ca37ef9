#!/usr/bin/env bash
# A/B of two trees in one device call: bash bench/ab_trees.sh OLD_DIR OLD_COMMIT NEW_COMMIT ROUNDS
# (OLD_DIR: a worktree of the older commit, carried with the call). For each round, in turn: the cold first
# token (3 runs) and (unless AB_BENCH=0) the llama-3.1-8b bench at prompts 128 / 2048, old tree then new.
# Rows under $OUT.
set -u
old_dir=$1 old_commit=$2 new_commit=$3 rounds=${4:-2}
root=$PWD
bash bench/device_run.sh > /dev/null 2>&1      # installs the wheels into /tmp/site
export PYTHONUNBUFFERED=1 KILNX_CACHE_DIR=/tmp/kilnx-cache KILNX_DB=${KILNX_DB:-sqlite:////tmp/kilnx-tune.db} \
       PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
run_tree() {  # dir commit tag
  cd "$1"; export KILNX_COMMIT=$2 PYTHONPATH=/tmp/site:$1
  python3 bench/cold_first_token.py --model llama-3.1-8b > /dev/null 2>&1     # fills this tree's caches
  for i in 1 2 3; do python3 bench/cold_first_token.py --model llama-3.1-8b --csv $OUT/cold_$3.csv | tail -1; done
  [ "${AB_BENCH:-1}" = 1 ] && timeout 200 python3 -m kilnx.cli bench --model llama-3.1-8b --random --prompt-lens 128,2048 --gen 64 \
    --device cuda --csv $OUT/e2e_$3.csv 2>&1 | grep "│ auto"
  cd "$root"
}
for r in $(seq $rounds); do
  echo "== round $r old $old_commit"; run_tree "$root/$old_dir" $old_commit old
  echo "== round $r new $new_commit"; run_tree "$root" $new_commit new
done
