#!/bin/sh
# conv-lanes.sh -- the forward 3x3 convs of stages 2-3 in the lanes layout (issue 13 P3,
# session 13: docs/layers.md), this checkout's build/ against BASE, side by side.
#
#   bash bench/conv-lanes.sh BASE        (BASE: a build directory made before the change)
#
# 1. One pair on 1 thread (base, then ours) (no split, no spinning threads: the passes' own cost),
#    PRECOND_POOL_STATS=1 bench-accel --only resnet --clock cpu, a run of 11 steps minus a
#    run of 2 (the first step's page faults drop out), per step: the forward convs' CPU ms
#    (loop kinds c3_fwd_part and c3_lanes_part: the convs followed by batch norm, their
#    moments included), the stride-1 input gradients with batch norm's backward sums
#    (c3_fwd_part.nomoments + grad_sums_slice before session 13, c3_fwd_part.bngrad +
#    c3_lanes_part.bngrad + grad_sums_slice after: helper bn13's change is in it too) and the
#    step's CPU median.
# 2. bench/bench-accel-vs-torch.sh build 2 3 BASE: the ResNet-20 step on 2 threads, base,
#    ours and PyTorch (torch-keep the fair row), 3 rounds.
# Run from the repository root after a build, on quiet cores: about 3 minutes.
set -eu
[ $# -eq 1 ] && [ -x "$1/bench/bench-accel" ] ||
  { echo "usage: bash bench/conv-lanes.sh BASE (a build directory with bench/bench-accel)" >&2; exit 2; }
base=$1
[ -x build/bench/bench-accel ] || { echo "build first: meson compile -C build" >&2; exit 2; }
run() { PRECOND_POOL_STATS=1 "$1/bench/bench-accel" --only resnet --threads 1 --reps "$2" --clock cpu 2>&1; }
echo "pair who   fwd_convs_cpu_ms  dgrad1_bnsums_cpu_ms  step_cpu_median_ms  (1 thread, per step)"
for pair in 1; do
  for who in base ours; do
    dir=build
    [ "$who" = base ] && dir=$base
    { run "$dir" 1 | sed 's/^/A /'; run "$dir" 10 | sed 's/^/B /'; } |
      awk -v p="$pair" -v who="$who" '
        $5 == "step" && $1 == "B" { step = $6 }
        $2 == "pool-stats" && $4 ~ /^[0-9]+$/ && ($3 == "c3_fwd_part" || $3 == "c3_lanes_part") {
          fwd += ($1 == "A" ? -1 : 1) * $10 }
        $2 == "pool-stats" && $4 ~ /^[0-9]+$/ && ($3 ~ /^c3_(fwd|lanes)_part[.](nomoments|bngrad)$/ ||
                                               $3 == "grad_sums_slice") {
          dg += ($1 == "A" ? -1 : 1) * $10 }
        END { printf "%-4s %-5s %16.1f %21.1f %19.1f\n", p, who, fwd / 9, dg / 9, step }'
  done
done
sh bench/bench-accel-vs-torch.sh build 2 3 "$base"
