#!/usr/bin/env bash
# libprecond's same-host push against the doorbell's own rows (issue 13 P2, session 14), the
# BASE build against this checkout's build/, pinned across cores (bench on core 0, its
# precondd on core 1, as bench/push-xcore.sh's "xcore"), n = 1024 (4.2 MB, the target's
# block; SIZE another n, e.g. 32: the control alone). About 1-2 minutes on quiet cores. Run
# from the repository root with build/ built.
# usage: bash bench/push-lib.sh BASE [ROUNDS [SIZE]]   (BASE: another build directory;
# ROUNDS: 3; SIZE: 1024)
# Rows (MB per CPU second of bench and daemon, --clock cpu, and the ratio to memcpy):
# push-shm (the doorbell, one push at a time, each answer awaited), push-shm-pipe (the
# doorbell pipelined by bench-daemon itself, two in flight) and, new build only, push-lib
# (libprecond's public API as a worker pushes, its background thread posting each push and
# collecting the answer later; the base has no such row) and push-lib-wait (the same with
# each answer awaited, precond_options.push_answer_wait; written in the region's worker
# slots too since session 15, later: in /work/base-s15 it still copies queue entries).
# Builds alternated ROUNDS times;
# prints every row, then per build and row the median and range of the ratios.
set -u
[ $# -ge 1 ] && [ $# -le 3 ] && [ -x "$1/bench/bench-daemon" ] && [ -x "$1/host/precondd" ] ||
  { echo "usage: bash bench/push-lib.sh BASE [ROUNDS [SIZE]] (BASE: a build directory)" >&2; exit 2; }
base=$(cd "$1" && pwd)
rounds=${2:-3}
size=${3:-1024}
case $rounds$size in '' | *[!0-9]*) echo "ROUNDS and SIZE must be numbers" >&2; exit 2 ;; esac
. "$(dirname "$0")/push-common.sh" # cd to the root, build/ checked, $tmp, pinned daemons
echo "round,build,row,mb_per_cpu_s,pushes_per_cpu_s,p50_ms,ratio_to_memcpy"
for round in $(seq "$rounds"); do
  for v in base new; do
    if [ $v = base ]; then b=$base/bench/bench-daemon; else b=build/bench/bench-daemon; fi
    taskset -c 0 "$b" --spawn "$tmp/pd1-$v.sh" --keep-freed-memory --wire --unix-only --shm-only \
      --clock cpu --seconds 1 --sizes "$size" --fetch-max 16 2>>"$tmp/log" |
      awk -F, -v r="$round" -v v=$v '$1 == "push-shm" || $1 == "push-shm-pipe" || $1 ~ /^push-lib/ {
        print r "," v "," $1 "," $7 "," $8 "," $9 "," $14 }'
  done
done | tee "$tmp/rows.csv"
echo
echo "build,row,rounds,median_ratio_to_memcpy,min,max,median_mb_per_cpu_s"
awk -F, "$(cat bench/median.awk)"'
  { k = $2 "," $3; n[k]++; q[k, n[k]] = $7; m[k, n[k]] = $4 }
  END { for (k in n) { r = med(q, k, n[k]); l = lo; h = hi; printf "%s,%d,%.4f,%.4f,%.4f,%.1f\n", k, n[k], r, l, h, med(m, k, n[k]) } }' \
  "$tmp/rows.csv" | sort
grep -hE "push-lib(-wait)?:" "$tmp/log" >&2 || true
