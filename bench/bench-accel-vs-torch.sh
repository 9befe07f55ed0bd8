#!/bin/sh
# bench-accel-vs-torch.sh -- the ResNet-20 training step (batch 128, the step of
# bench-accel --only models) against PyTorch's (bench/reference/resnet_torch.py, Debian
# python3-torch, oneDNN) on the same cores, alternated, for issue 13's ratio (ours at most
# 1.0x PyTorch's, 2 threads). Each round runs each side ONCE and reads the wall clock and the
# process CPU time around every one of its 10 steps, so the two columns are medians of the
# same steps (an earlier version ran a wall run and a CPU run apart, and PyTorch's bimodal
# step could put a fast wall median next to a slow CPU median: 135 ms wall against 720 ms
# of CPU at 2 threads). Also the Transformer LM step (bench-accel's other model line).
#
#   bench/bench-accel-vs-torch.sh [BUILD_DIR] [THREADS] [ROUNDS] [BASE_BUILD_DIR]
#                                                                    (defaults: build 2 3, none)
#
# BASE_BUILD_DIR (optional): another build of bench-accel (e.g. the session's starting
# point) run in the same rounds, right before ours, as "base": a change's effect side by
# side. cpu/wall of our rows is the cores the step kept busy (2 at most on 2 threads).
#
# PyTorch runs twice per round: as installed ("torch"), and with glibc's malloc told to keep
# its memory ("torch-keep": GLIBC_TUNABLES mmap_threshold 32 MB, glibc's largest, and
# trim_threshold 4 GB, for that process only). Its bimodal step is glibc's malloc: a run
# whose large tensors land in mmap'd or trimmed memory page-faults them in again on every
# step (docs/layers.md, session 9); "torch-keep" is its fast mode every time, the fair
# figure to compare with.
#
# Run from the repository root, after a build, on quiet cores: about 1.5 minutes. Prints
# "round who model wall_median_ms cpu_median_ms cpu/wall wall_best_ms" per run, PyTorch's
# threads, and the load average before and after.
set -eu
build=${1:-build}
threads=${2:-2}
rounds=${3:-3}
base=${4:-}
uptime
echo "round  who    model           wall_ms   cpu_ms  cpu/wall  best_wall_ms"
for r in $(seq "$rounds"); do
  for who in ${base:+base} ours; do
    dir=$build
    [ "$who" = base ] && dir=$base
    "$dir/bench/bench-accel" --only models --threads "$threads" --reps 10 |
      awk -v r="$r" -v who="$who" '$4 == "step" { w[$3] = $5; b[$3] = $7 } $4 == "step.cpu" { c[$3] = $5 }
        END { for (m in w) printf "%-6s %-6s %-14s %8.1f %8.1f %8.2f %10.1f\n", r, who, m, w[m], c[m], c[m] / w[m], b[m] }'
  done
  for who in torch torch-keep; do
    tun=
    [ "$who" = torch-keep ] && tun=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967295
    env ${tun:+GLIBC_TUNABLES=$tun} /usr/bin/python3 bench/reference/resnet_torch.py --threads "$threads" --reps 10 |
      awk -v r="$r" -v who="$who" '$1 == "model" && $(NF-4) == "step" { w = $(NF-3); b = $(NF-1) }
        $1 == "model" && $(NF-4) == "step.cpu" { c = $(NF-3) }
        $1 == "threads" { t = $0 }
        END { printf "%-6s %-6s %-14s %8.1f %8.1f %8.2f %10.1f\n", r, who, "resnet", w, c, c / w, b; print "      " t }'
  done
done
uptime
