#!/usr/bin/env bash
# bench/wire.sh -- the wire figures of docs/precondd.md ("Wire"), in one run of under three
# minutes on quiet cores (3.6 on the loaded development machine with n = 4096 rows too,
# which are left out: one call each in a cell):
#   rows.csv   bench-daemon --wire: per block size (256, 1024) a memcpy row, then push
#              and fetch over TCP, the unix socket's bytes and the same-host path (push-shm,
#              fetch-shm), in MB per CPU second of bench and daemon together (--clock cpu),
#              each with its ratio to a memcpy of the same bytes measured right before it;
#   hist.txt   the latency histogram of 256-block calls over the unix socket (--hist): the
#              p99 of fetch-shm at n = 256 against 1 ms;
#   args.csv   TCP at n = 1024 under each candidate gRPC argument, set on both sides, one at a
#              time, between two rounds of gRPC's defaults (which the code keeps: a candidate
#              earns its place only if it beats both default rounds in this file);
#   base.csv   with --base DIR (a folder holding another build's bench-daemon and precondd,
#              e.g. main before a change) instead of args.csv: the push rows at n = 1024
#              (TCP, unix socket bytes, push-shm and its variants) of DIR's binaries and
#              these, alternated --rounds times (3: base, new, base, new, base, new), so
#              before/after ratios come from one run;
#   summary.csv with --base: per build and row the median of the rounds and their range
#              (min, max), MB per CPU second and ratio to memcpy: one noisy round moves the
#              range, not the median;
#   wall.csv   the same-host push rows at n = 1024 on the wall clock (no --clock cpu):
#              push-shm-pipe pipelines RPC_SHM_QUEUE = 2 pushes (the client writes push
#              k + 1 while the daemon folds push k), so on quiet cores its wall-clock rate
#              shows the overlap, which the CPU clock does not reward.
# push-shm is the doorbell one push at a time (the target row, as in session 9),
# push-shm-pipe the doorbell with 2 pushes in flight, push-shm-grpc the push with gRPC
# control.
# Run from the repository root (it reads bench/median.awk) after `meson compile -C build`.
set -u

build="${PRECOND_BUILD:-build}" out="out/wire" secs=1.5 base= rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --seconds) secs="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --help) echo "Usage: bench/wire.sh [--build DIR] [--out DIR] [--seconds S (1.5, per cell)] [--base DIR] [--rounds R (3)]"; exit 0 ;;
    *) echo "wire.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
bd="$build/bench/bench-daemon" pd="$build/host/precondd"
[ -x "$bd" ] && [ -x "$pd" ] || { echo "wire.sh: build $bd and $pd first" >&2; exit 2; }
mkdir -p "$out"
export OPENBLAS_NUM_THREADS=1
bench() { "$bd" --spawn "$pd" --keep-freed-memory --wire --clock cpu --seconds "$secs" "$@"; }

bench --sizes 256,1024 --fetch-max 1024 > "$out/rows.csv" 2> "$out/rows.log"
bench --unix-only --hist --sizes 256 --seconds 4 > "$out/hist.csv" 2> "$out/hist.txt"
"$bd" --spawn "$pd" --keep-freed-memory --wire --unix-only --shm-only --seconds "$secs" --sizes 1024 \
    --fetch-max 256 2>> "$out/wall.log" | awk -F, 'NR == 1 || $1 ~ /^(push|memcpy$)/' > "$out/wall.csv"

if [ -n "$base" ]; then
  [ -x "$base/bench-daemon" ] && [ -x "$base/precondd" ] || { echo "wire.sh: no $base/bench-daemon, $base/precondd" >&2; exit 2; }
  echo "round,build,row,transport,block,mb_per_cpu_s,ratio,p50_ms" > "$out/base.csv"
  for round in $(seq "$rounds"); do
    for v in base new; do
      if [ $v = base ]; then b="$base/bench-daemon" p="$base/precondd"; else b="$bd" p="$pd"; fi
      "$b" --spawn "$p" --keep-freed-memory --wire --clock cpu --seconds "$secs" --sizes 1024 \
          --fetch-max 256 2>> "$out/base.log" |
        awk -F, -v r=$round -v v=$v '$1 ~ /^push/ { print r "," v "," $1 "," $2 "," $3 "," $7 "," $14 "," $9 }' >> "$out/base.csv"
    done
  done
  # Median and range of the rounds per build and row (the rows of base.csv, by round).
  awk -F, "$(cat bench/median.awk)"'
    NR > 1 { k = $2 "," $3 "," $4 "," $5; n[k]++; v[k, n[k]] = $6; r[k, n[k]] = $7 }
    END {
      for (k in n) {
        mv = med(v, k, n[k]); vlo = lo; vhi = hi
        mr = med(r, k, n[k])
        printf "%s,%d,%.1f,%.1f,%.1f,%.4f,%.4f,%.4f\n", k, n[k], mv, vlo, vhi, mr, lo, hi
      }
    }' "$out/base.csv" | sort -t, -k2,2 -k1,1 > "$out/summary.tmp"
  { echo "build,row,transport,block,rounds,mb_per_cpu_s_median,mb_per_cpu_s_min,mb_per_cpu_s_max,ratio_median,ratio_min,ratio_max"
    cat "$out/summary.tmp"; } > "$out/summary.csv" && rm -f "$out/summary.tmp"
  echo "wire.sh: $out/rows.csv, $out/hist.txt, $out/wall.csv, $out/base.csv, $out/summary.csv"
  exit 0
fi

echo "arg,row,mb_per_cpu_s,p50_ms" > "$out/args.csv"
for a in default grpc.http2.max_frame_size=16777215 grpc.http2.lookahead_bytes=67108864 \
         grpc.http2.write_buffer_size=8388608 grpc.http2.bdp_probe=0 \
         grpc.experimental.tcp_read_chunk_size=4194304 grpc.experimental.tcp_max_read_chunk_size=8388608 \
         grpc.experimental.tcp_min_read_chunk_size=262144 default; do
  set -- --tcp-only --sizes 1024
  [ "$a" != default ] && set -- "$@" --channel-arg "$a" --daemon-arg --grpc-arg --daemon-arg "$a"
  bench "$@" 2>> "$out/args.log" | awk -F, -v a="$a" '$1 == "push" || $1 == "fetch" { print a "," $1 "," $7 "," $9 }' >> "$out/args.csv"
done
echo "wire.sh: $out/rows.csv, $out/hist.txt, $out/wall.csv, $out/args.csv"
