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
#              (TCP, unix socket bytes, push-shm) of DIR's binaries and these, alternated
#              twice (base, new, base, new), so before/after ratios come from one run.
# Run from the repository root after `meson compile -C build`.
set -u

build="${PRECOND_BUILD:-build}" out="out/wire" secs=1.5 base=
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --seconds) secs="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --help) echo "Usage: bench/wire.sh [--build DIR] [--out DIR] [--seconds S (1.5, per cell)] [--base DIR]"; exit 0 ;;
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

if [ -n "$base" ]; then
  [ -x "$base/bench-daemon" ] && [ -x "$base/precondd" ] || { echo "wire.sh: no $base/bench-daemon, $base/precondd" >&2; exit 2; }
  echo "round,build,row,transport,block,mb_per_cpu_s,ratio,p50_ms" > "$out/base.csv"
  for round in 1 2; do
    for v in base new; do
      if [ $v = base ]; then b="$base/bench-daemon" p="$base/precondd"; else b="$bd" p="$pd"; fi
      "$b" --spawn "$p" --keep-freed-memory --wire --clock cpu --seconds "$secs" --sizes 1024 \
          --fetch-max 256 2>> "$out/base.log" |
        awk -F, -v r=$round -v v=$v '$1 ~ /^push/ { print r "," v "," $1 "," $2 "," $3 "," $7 "," $14 "," $9 }' >> "$out/base.csv"
    done
  done
  echo "wire.sh: $out/rows.csv, $out/hist.txt, $out/base.csv"
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
echo "wire.sh: $out/rows.csv, $out/hist.txt, $out/args.csv"
