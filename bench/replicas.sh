#!/usr/bin/env bash
# bench/replicas.sh -- the figures of docs/replicas.md, side by side in one run:
#   roots.csv  daemon replicas: bench-daemon's replica rows (mpirun -np 1 and 2 precondd, one
#              pool thread per rank, the same 16 blocks of 256 with eigh roots, each pushed
#              to the rank that owns it through shared memory, 16 timed steps after 2
#              untimed ones): roots/s and the time from a step's push to every rank holding
#              every root; then the same rows per CPU second of the busiest rank (--clock
#              cpu: what load leaves out), each after a "ceiling" row: the same roots in R
#              plain processes pinned to cores 0..R-1, the machine's own limit (--ceiling);
#              roots-*.log: per step the phases, per rank its CPU per step (pool, replica
#              thread, other threads) and the bench's own; the ceiling's per core;
#   dp.csv     data-parallel training (the default models and global batches, --sync-roots so
#              the losses compare): the Transformer with Shampoo, the ResNet with Shampoo
#              and with K-FAC (batch norm across the workers), W workers on W daemon ranks
#              for W = 1, 2 (both under mpirun): final train loss, the largest relative loss
#              difference to W = 1, median step time, and per worker the CPU time of its
#              statistics (K-FAC: factors) per step, the gradient averaging and the other
#              reductions (batch norm, K-FAC factors) per step;
#   dp-MODEL-OPT-W/  each run's train.csv and summary.json (rank 0), its log.
# Run from the repository root after `meson compile -C build`. Needs mpirun (openmpi-bin).
set -u

build="${PRECOND_BUILD:-build}" out="out/replicas" steps=30 rsteps=10
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --resnet-steps) rsteps="$2"; shift 2 ;;
    --help) echo "Usage: bench/replicas.sh [--build DIR] [--out DIR] [--steps N (30, Transformer)] [--resnet-steps N (10)]"; exit 0 ;;
    *) echo "replicas.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mpirun=$(command -v mpirun) || { echo "replicas.sh: mpirun not found (openmpi-bin)" >&2; exit 2; }
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
mkdir -p "$out"
echo "replicas.sh: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2

for clock in wall cpu; do
  "$build/bench/bench-daemon" --spawn "$build/host/precondd" --mpirun "$mpirun" --ranks 1,2 --ceiling \
    --pool-blocks 16 --replica-steps 16 --clock "$clock" > "$out/roots-$clock.csv" \
    2> "$out/roots-$clock.log" || exit 1
  sed -i "1!s/^/$clock,/;1s/^/clock,/" "$out/roots-$clock.csv"
done
{ cat "$out/roots-wall.csv"; tail -n +2 "$out/roots-cpu.csv"; } > "$out/roots.csv"

tmp=$(mktemp -d /tmp/replicas-bench-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
echo "model,optimizer,workers,daemon_ranks,steps,final_train_loss,max_rel_loss_diff,median_step_ms,worker,stats_cpu_ms_per_step,blocks_mine,blocks,allreduce_ms_per_step,reductions_ms_per_step" > "$out/dp.csv"
for cfg in "transformer shampoo $steps" "resnet shampoo $rsteps" "resnet kfac $rsteps"; do
  read -r model opt n <<< "$cfg"
  for w in 1 2; do
    name="$model-$opt-$w"
    rm -f "$tmp"/p$w-*
    "$mpirun" "${root[@]}" --oversubscribe -np "$w" "$build/host/precondd" \
      --listen "unix:$tmp/d$w-%r.sock" --port-file "$tmp/p$w-%r" --threads 1 \
      --log-level warn 2> "$out/daemons-$name.log" &
    daemons=$!
    for r in $(seq 0 $((w - 1))); do
      for _ in $(seq 1 300); do [ -s "$tmp/p$w-$r" ] && break; sleep 0.1; done
    done
    rm -rf "$out/dp-$name"
    "$mpirun" "${root[@]}" --oversubscribe -np "$w" "$build/bench/$model" \
      --optimizer "$opt" --sync-roots --steps "$n" --eval-every 0 --eval-batches 2 \
      --quiet --daemon "unix:$tmp/d$w-%r.sock" --out "$out/dp-$name" > "$out/dp-$name.log" 2>&1
    pkill -TERM -P "$daemons"; wait "$daemons"
    ref="$out/dp-$model-$opt-1/train.csv" cur="$out/dp-$name/train.csv"
    diff=$(paste -d, <(tail -n +2 "$ref" | cut -d, -f4) <(tail -n +2 "$cur" | cut -d, -f4) |
           awk -F, '{d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > m) m = d} END {printf "%.3g", m}')
    final=$(tail -n 1 "$cur" | cut -d, -f4)
    median=$(sed -n 's/.*median step \([0-9.]*\) ms.*/\1/p' "$out/dp-$name.log" | head -n 1)
    # Per worker: its statistics line and (ResNet, K-FAC) its reductions line, by rank.
    awk -v pre="$model,$opt,$w,$w,$n,$final,$diff,$median" '
      /^data-parallel worker [0-9]+ of [0-9]+: statistics/ {
        r = $3; st[r] = $7; mine[r] = substr($12, 2); all[r] = $14; ar[r] = $(NF - 3); seen[r] = 1 }
      /^data-parallel worker [0-9]+ of [0-9]+: reductions across workers/ { red[$3] = $(NF - 5) }
      END { for (r in seen) print r "," pre "," r "," st[r] "," mine[r] "," all[r] "," ar[r] "," (r in red ? red[r] : 0) }' \
      "$out/dp-$name.log" | sort -n | cut -d, -f2- >> "$out/dp.csv"
  done
done
cat "$out/roots.csv" "$out/dp.csv"
