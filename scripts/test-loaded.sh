#!/usr/bin/env bash
# The suite as CI runs it, on a busy machine: a fresh clone of HEAD, `CI=true bash .ci/run`
# RUNS times in a row (default 3) while BURNERS CPU-bound processes (default 2) run beside it.
# A test that passes only on an idle machine is a broken test; this is how to find it.
#   make test-loaded              # 3 runs, 2 burners
#   RUNS=1 BURNERS=4 make test-loaded
# Each run's output is kept in the clone's folder (printed at the end); the burners are ended
# by their process ids whatever happens. Exits non-zero if any run failed.
set -uo pipefail
runs=${RUNS:-3}
burners=${BURNERS:-2}
top=$(git rev-parse --show-toplevel)
work=$(mktemp -d -t collective-loaded-XXXXXX)
git clone -q "$top" "$work/p"

pids=()
stop_burners() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
}
trap stop_burners EXIT
for _ in $(seq 1 "$burners"); do
  python3 -c 'while 1: pass' &
  pids+=("$!")
done
echo "load: ${burners} CPU-bound process(es), pids ${pids[*]}; clone of $(git -C "$top" rev-parse --short HEAD) in $work/p"

failed=0
for i in $(seq 1 "$runs"); do
  log="$work/run-$i.log"
  start=$(date +%s)
  (cd "$work/p" && CI=true bash .ci/run </dev/null >"$log" 2>&1)
  code=$?
  took=$(( $(date +%s) - start ))
  closing=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -n 1)
  echo "run $i: exit $code in ${took} s: ${closing:-no closing line}"
  if [ "$code" -ne 0 ]; then
    failed=$((failed + 1))
    grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
  fi
done
echo "$((runs - failed)) of $runs run(s) passed under load; logs in $work"
[ "$failed" -eq 0 ]
