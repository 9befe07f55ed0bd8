#!/bin/sh
# bench-accel-vs-torch.sh -- the ResNet-20 training step (batch 128, the step of
# bench-accel --only models) against PyTorch's (bench/reference/resnet_torch.py, Debian
# python3-torch, oneDNN) on the same cores, alternated, for issue 13's ratio (ours at most
# 1.0x PyTorch's, 2 threads). Wall clock, then process CPU time, each round; medians of 10
# steps. Also the Transformer LM step (bench-accel's other model line).
#
#   bench/bench-accel-vs-torch.sh [BUILD_DIR] [THREADS] [ROUNDS]    (defaults: build 2 3)
#
# Run from the repository root, after a build, on quiet cores: about 1-2 minutes. Prints
# "who clock model median_ms best_ms" per run and the load average before and after.
set -eu
build=${1:-build}
threads=${2:-2}
rounds=${3:-3}
uptime
for r in $(seq "$rounds"); do
  for clock in wall cpu; do
    "$build/bench/bench-accel" --only models --threads "$threads" --reps 10 --clock "$clock" |
      awk -v c="$clock" -v r="$r" '$4 == "step" { print "round " r "  ours   " c "  " $3 "  " $5 "  " $7 }'
    /usr/bin/python3 bench/reference/resnet_torch.py --threads "$threads" --reps 10 \
      --clock "$clock" |
      awk -v c="$clock" -v r="$r" '/step/ { print "round " r "  torch  " c "  resnet  " $(NF-3) "  " $(NF-1) }'
  done
done
uptime
