#!/bin/bash
# W2's step time (issue 8): the ResNet's median step against SGD's, with precondd beside the
# worker. SGD, the BASE build's Shampoo, this build's Shampoo (its defaults: the ResNet row's
# --root-every), and the same with the daemon's pool threads reniced to 19, alternated,
# STEPS steps each, ROUNDS rounds. Each run has its own precondd --threads 1 from its own
# build; printed per run: median step wall and CPU ms, the daemon's CPU (utime + stime from
# /proc over the run) per step, the roots it computed + skipped (drift test), the worker's
# staleness mean; then per round Shampoo / SGD wall ratios. About 2 minutes on quiet cores.
# Fashion-MNIST from PRECOND_DATA_DIR or Debian's package, as bench/resnet reads it.
# usage: bash bench/w2-step.sh BUILD BASE [STEPS (40)] [ROUNDS (2)]   (BASE: another build dir)
set -u
[ $# -ge 2 ] || { echo "usage: bash bench/w2-step.sh BUILD BASE [STEPS] [ROUNDS]" >&2; exit 2; }
B=$1; BASE=$2; S=${3:-40}; R=${4:-2}
tck=$(getconf CLK_TCK)
echo "== w2-step $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
run() { # name build optimizer lr [extra...]
  local name=$1 b=$2 o=$3 lr=$4; shift 4
  local T; T=$(mktemp -d)
  $b/host/precondd --listen unix:$T/s --state-dir $T/st --threads 1 --snapshot-interval 60 --log-level warn & local d=$!
  for i in $(seq 50); do [ -S $T/s ] && break; sleep 0.1; done; sleep 0.2
  if [ -n "${NICE_POOL:-}" ]; then
    for t in /proc/$d/task/*; do [ "$(cat $t/comm)" = pd-pool ] && renice -n $NICE_POOL -p ${t##*/} >/dev/null; done
  fi
  local c0; c0=$(awk '{print $14+$15}' /proc/$d/stat)
  OPENBLAS_NUM_THREADS=1 $b/bench/resnet --daemon unix:$T/s --out $T/r --job $name --optimizer $o --lr $lr --steps $S --eval-every 0 --eval-batches 1 --quiet --threads 2 "$@" > $T/log 2>&1 || { echo "$name failed"; tail -3 $T/log; }
  local c1; c1=$(awk '{print $14+$15}' /proc/$d/stat)
  local roots; roots=$($b/client/precondctl --addr unix:$T/s stats 2>/dev/null | awk '/^roots/{print $2"+"$6}')
  kill $d; wait $d 2>/dev/null
  local wall cpu
  wall=$(sed -n 's/.*"median_step_ms": *\([0-9.]*\).*/\1/p' $T/r/summary.json)
  cpu=$(sed -n 's/.*"median_step_cpu_ms": *\([0-9.]*\).*/\1/p' $T/r/summary.json)
  stale=$(sed -n 's/.*"staleness_mean": *\([0-9.]*\).*/\1/p' $T/r/summary.json)
  printf "%-12s wall_ms %7.1f  cpu_ms %7.1f  daemon_cpu_ms_per_step %6.1f  roots(computed+skipped) %-9s staleness %s\n" \
    $name "$wall" "$cpu" "$(echo "($c1-$c0)*1000/$tck/$S" | bc -l)" "$roots" "${stale:--}"
  echo "$name $wall" >> $T/../w2step-walls.$$
  rm -rf $T
}
for r in $(seq $R); do
  run sgd$r $B sgd 0.1
  run base$r $BASE shampoo 3e-3
  run new$r $B shampoo 3e-3
  NICE_POOL=19 run nice$r $B shampoo 3e-3
done
echo "== done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
f=$(dirname $(mktemp -u))/w2step-walls.$$
for r in $(seq $R); do
  awk -v r=$r '$1=="sgd"r{s=$2} $1=="base"r{b=$2} $1=="new"r{n=$2} $1=="nice"r{c=$2} END{printf "round %d: Shampoo / SGD median step wall: base %.2fx  new %.2fx  new+nice %.2fx\n", r, b/s, n/s, c/s}' $f
done
rm -f $f
