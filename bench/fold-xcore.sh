#!/usr/bin/env bash
# precondd's CPU per same-host push of a 1024 block (4.2 MB) across cores, the BASE build
# against this checkout's build/, and the fold's forms (issue 13 P2; docs/precondd.md,
# "The fold's forms, and the doorbell thread's parts (session 14)"). About 2 minutes on quiet
# cores. Run from the repository root with build/ built (meson compile -C build); BASE is
# another build directory with bench/bench-daemon and host/precondd.
# usage: bash bench/fold-xcore.sh BASE
# Prints:
#   1. rows: build,round,row,ratio_to_memcpy,bell_us,bell_system_pct,client_us,bell_sleeps
#      for push-shm (one push at a time, each answer awaited) and push-shm-pipe (two in
#      flight), n = 1024, bench pinned to core 0 and its precondd to core 1, base and new
#      alternated over 3 rounds (bench-daemon --account: the doorbell thread's CPU per push);
#   2. their medians per build and row;
#   3. bench-xcore's fold rows of this build, twice (no daemon: the consumer's CPU per
#      hand-off, us; keep is the daemon's fold, inplace the bound of a fold with no spare).
set -u
[ $# -eq 1 ] && [ -x "$1/bench/bench-daemon" ] && [ -x "$1/host/precondd" ] ||
  { echo "usage: bash bench/fold-xcore.sh BASE (a build directory with bench/bench-daemon and host/precondd)" >&2; exit 2; }
base=$(cd "$1" && pwd)
. "$(dirname "$0")/push-common.sh" # cd to the root, build/ checked, $tmp, pinned daemons
[ -x build/bench/bench-xcore ] || { echo "build first: meson compile -C build" >&2; exit 2; }
echo "build,round,row,ratio_to_memcpy,bell_us,bell_system_pct,client_us,bell_sleeps"
for round in 1 2 3; do
  for v in base new; do
    if [ $v = base ]; then b=$base/bench/bench-daemon; else b=build/bench/bench-daemon; fi
    taskset -c 0 "$b" --spawn "$tmp/pd1-$v.sh" --keep-freed-memory --wire --unix-only --shm-only \
      --clock cpu --seconds 1 --sizes 1024 --fetch-max 16 --account 2>&1 |
      awk -F, -v v=$v -v r=$round '
        /^account push-shm(-pipe)? n=1024/ {
          split($0, w, " "); row = w[2]
          match($0, /client [0-9.]+/); c[row] = substr($0, RSTART + 7, RLENGTH - 7)
          match($0, /bell thread [0-9.]+ \(system [0-9]+/); s = substr($0, RSTART, RLENGTH)
          split(s, q, /[ (]+/); bu[row] = q[3]; bs[row] = q[5]
          match($0, /bell sleeps [0-9.]+/); sl[row] = substr($0, RSTART + 12, RLENGTH - 12)
        }
        $1 == "push-shm" || $1 == "push-shm-pipe" { ratio[$1] = $14 }
        END { for (k in ratio) printf "%s,%s,%s,%s,%s,%s,%s,%s\n", v, r, k, ratio[k], bu[k], bs[k], c[k], sl[k] }'
  done
done | tee "$tmp/rows.csv"
echo
echo "build,row,rounds,median_ratio_to_memcpy,median_bell_us,median_client_us"
awk -F, "$(cat bench/median.awk)"'
  { k = $1 "," $3; n[k]++; a[k, n[k]] = $4; b[k, n[k]] = $5; c[k, n[k]] = $7 }
  END { for (k in n) printf "%s,%d,%.4f,%.1f,%.1f\n", k, n[k], med(a, k, n[k]), med(b, k, n[k]), med(c, k, n[k]) }' \
  "$tmp/rows.csv" | sort
echo
for i in 1 2; do
  build/bench/bench-xcore --rounds 9 --reps 30 --consumers keep,inplace,copy,check,fold-nt,keep-plain,keep-pf,sum |
    awk -F, 'NR == 1 || $1 == "memcpy" || ($1 ~ /^nt512\+/ && $1 !~ /thp/)' | cut -d, -f1,8,9,10,13
done
