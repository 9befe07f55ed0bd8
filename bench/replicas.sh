#!/usr/bin/env bash
# bench/replicas.sh -- the figures of docs/replicas.md, side by side in one run:
#   roots.csv  daemon replicas: bench-daemon's replica rows (mpirun -np 1 and 2 precondd, one
#              pool thread per rank, the same 16 blocks of 256 pushed to rank 0 per step):
#              roots/s and the time from a step's push to every rank holding every root;
#   dp.csv     data-parallel Transformer (the default model and global batch, --sync-roots so
#              the losses compare): W workers on W daemon ranks for W = 1, 2 (both under
#              mpirun): final train loss, the largest relative loss difference to W = 1,
#              median step time, and per worker the CPU time of its statistics per step;
#   dp-W/      each run's train.csv and summary.json (rank 0), its log.
# Run from the repository root after `meson compile -C build`. Needs mpirun (openmpi-bin).
set -u

build="${PRECOND_BUILD:-build}" out="out/replicas" steps=30
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --help) echo "Usage: bench/replicas.sh [--build DIR] [--out DIR] [--steps N (30)]"; exit 0 ;;
    *) echo "replicas.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mpirun=$(command -v mpirun) || { echo "replicas.sh: mpirun not found (openmpi-bin)" >&2; exit 2; }
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
mkdir -p "$out"
echo "replicas.sh: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2

"$build/bench/bench-daemon" --spawn "$build/host/precondd" --mpirun "$mpirun" --ranks 1,2 \
  --pool-blocks 16 > "$out/roots.csv" || exit 1

tmp=$(mktemp -d /tmp/replicas-bench-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
echo "workers,daemon_ranks,steps,final_train_loss,max_rel_loss_diff,median_step_ms,worker,stats_cpu_ms_per_step,blocks_mine,blocks,allreduce_ms_per_step" > "$out/dp.csv"
for w in 1 2; do
  "$mpirun" "${root[@]}" --oversubscribe -np "$w" "$build/host/precondd" \
    --listen "unix:$tmp/d$w-%r.sock" --port-file "$tmp/p$w-%r" --threads 1 \
    --log-level warn 2> "$out/daemons-$w.log" &
  daemons=$!
  for r in $(seq 0 $((w - 1))); do
    for _ in $(seq 1 300); do [ -s "$tmp/p$w-$r" ] && break; sleep 0.1; done
  done
  rm -rf "$out/dp-$w"
  "$mpirun" "${root[@]}" --oversubscribe -np "$w" "$build/bench/transformer" \
    --optimizer shampoo --sync-roots --steps "$steps" --eval-every 0 --eval-batches 2 \
    --quiet --daemon "unix:$tmp/d$w-%r.sock" --out "$out/dp-$w" > "$out/dp-$w.log" 2>&1
  pkill -TERM -P "$daemons"; wait "$daemons"
  ref="$out/dp-1/train.csv" cur="$out/dp-$w/train.csv"
  diff=$(paste -d, <(tail -n +2 "$ref" | cut -d, -f4) <(tail -n +2 "$cur" | cut -d, -f4) |
         awk -F, '{d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > m) m = d} END {printf "%.3g", m}')
  final=$(tail -n 1 "$cur" | cut -d, -f4)
  median=$(sed -n 's/.*median step \([0-9.]*\) ms.*/\1/p' "$out/dp-$w.log" | head -n 1)
  sed -n 's/^data-parallel worker \([0-9]*\) of [0-9]*: statistics \([0-9.]*\) ms CPU per step (\([0-9]*\) of \([0-9]*\) blocks), gradient averaging \([0-9.]*\) ms per step/\1,\2,\3,\4,\5/p' \
    "$out/dp-$w.log" | sort -n | while IFS=, read -r rank st mine all ar; do
      echo "$w,$w,$steps,$final,$diff,$median,$rank,$st,$mine,$all,$ar"
    done >> "$out/dp.csv"
done
cat "$out/roots.csv" "$out/dp.csv"
