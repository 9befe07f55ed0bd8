#!/usr/bin/env bash
# The same-host push across cores (issue 13 P2), the BASE build against this checkout's
# build/, on quiet cores. Run from the repository root with build/ built (meson compile -C
# build); BASE is another build directory (e.g. a copy of build/ made before a change).
# About 7-8 minutes on quiet cores (session 13: 7 min; much longer under load).
# usage: bash bench/push-xcore.sh BASE
# Builds: base; new (this checkout: since session 14 libprecond posts a same-host push at the
# region's doorbell and collects its answer later). Session 12's third build, nap
# (PRECOND_SHM_NAP_US=2000), lost on quiet cores and is left out; set NAP=1 to run it.
# Prints CSV to stdout:
#   placement,round,build,block,row,mb_per_cpu_s,pushes_per_cpu_s,p50_ms,ratio_to_memcpy
# placement "as-is": the scheduler places bench and daemon; "xcore": bench pinned to core 0,
# its precondd to core 1 (every wake crosses cores). Rows: memcpy (the one-core limit),
# push-shm (the doorbell, one push at a time, each answer awaited), push-shm-pipe (the
# doorbell pipelined by bench-daemon itself, two in flight) and, new builds only, push-lib
# (libprecond's public API as a worker pushes: its background thread copies the push into
# the region and posts it, the answer collected later; the base has no such row: compare it
# with both builds' push-shm) and push-lib-wait (the same, each answer awaited), n = 1024 (4.2 MB, the target) and n = 32 (4 KB: the control
# alone). Builds alternated 3 rounds; then medians; last base's and new's --account lines at
# n = 32 and 1024 across cores (CPU per push by part; the doorbell thread's CPU in the 300 ms
# after the last push); then bench-xcore's fold rows (no daemon: the fold into the spare
# against the fold in place, across cores and on one core, 5 rounds).
set -u
[ $# -eq 1 ] && [ -x "$1/bench/bench-daemon" ] ||
  { echo "usage: bash bench/push-xcore.sh BASE (a build directory with bench/bench-daemon)" >&2; exit 2; }
base=$(cd "$1" && pwd)
. "$(dirname "$0")/push-common.sh" # cd to the root, build/ checked, $tmp, pinned daemons
run() { # run BUILD PLACE [more bench options]
  local v=$1 place=$2 b p pin= nap=
  shift 2
  if [ $v = base ]; then b=$base/bench/bench-daemon p=$base/host/precondd; else b=build/bench/bench-daemon p=build/host/precondd; fi
  [ $v = nap ] && nap=2000
  if [ $place = xcore ]; then pin="taskset -c 0"; if [ $v = base ]; then p=$tmp/pd1-base.sh; else p=$tmp/pd1-new.sh; fi; fi
  PRECOND_SHM_NAP_US=$nap $pin "$b" --spawn "$p" --keep-freed-memory --wire --unix-only --shm-only \
    --clock cpu --seconds 1 --sizes 32,1024 --fetch-max 16 "$@"
}
echo "placement,round,build,block,row,mb_per_cpu_s,pushes_per_cpu_s,p50_ms,ratio_to_memcpy"
for round in 1 2 3; do
  for place in xcore as-is; do
    for v in base new ${NAP:+nap}; do
      run $v $place 2>>"$tmp/log" |
        awk -F, -v r=$round -v v=$v -v pl=$place \
          '$1 == "memcpy" || $1 == "push-shm" || $1 == "push-shm-pipe" || $1 ~ /^push-lib/ { print pl "," r "," v "," $3 "," $1 "," $7 "," $8 "," $9 "," $14 }'
    done
  done
done | tee "$tmp/rows.csv"
echo
echo "placement,build,block,row,rounds,median_mb_per_cpu_s,median_pushes_per_cpu_s,median_ratio_to_memcpy"
awk -F, "$(cat bench/median.awk)"'
  $5 ~ /^push/ { k = $1 "," $3 "," $4 "," $5; n[k]++; v[k, n[k]] = $6; o[k, n[k]] = $7; q[k, n[k]] = $9 }
  END { for (k in n) printf "%s,%d,%.1f,%.1f,%.4f\n", k, n[k], med(v, k, n[k]), med(o, k, n[k]), med(q, k, n[k]) }' \
  "$tmp/rows.csv" | sort
echo
for v in base new ${NAP:+nap}; do
  run $v xcore --account --push-shm-only 2>&1 >/dev/null | grep '^account push-shm ' | sed "s/^/$v /"
done
echo
build/bench/bench-xcore --rounds 5 --reps 20 |
  awk -F, 'NR == 1 || $1 == "memcpy" || $1 ~ /^nt512\+(fold|keep)\/shm/' | cut -d, -f1,8,9,10,13,15
