#!/bin/sh
# resnet-passes.sh -- the ResNet-20 training step's CPU time by pass, ours against PyTorch's,
# on 1 thread (no spinning threads, no split: each pass's own cost), for issue 13 part 3.
#
#   bench/resnet-passes.sh [BUILD_DIR] [BASE_BUILD_DIR]                  (default: build)
#
# BASE_BUILD_DIR (optional): another build (e.g. the session's starting point) whose passes
# are printed first, right before ours, in the same minutes: a change's effect by pass.
# Ours: bench-accel --only resnet with PRECOND_POOL_STATS=1, a run of 11 steps minus a run
# of 2 (the first step's page faults and the pool stats' start-up drop out): CPU ms per step
# of every loop kind, and for the direct convs the shares of their phases (packing, products,
# copy-out; wall time within the loop). "c3_fwd_part" is the forward convs (their outputs'
# moments made in the copy-out; "c3_lanes_part" those of stages 2-3 in the lanes layout,
# session 13), "c3_fwd_part.bngrad" the stride-1 input gradients (a conv of dy; in the
# copy-out the residual's add, the ReLU's mask and the batch norm's backward sums;
# "c3_fwd_part.nomoments" before session 13), "c3_dgrad_part" the stride-2 input gradients,
# "c3_wgrad_part" the weight gradients; "grad_sums_slice" and "combine_slice" batch norm's
# backward passes. PyTorch: bench/reference/resnet_torch.py --profile (each op's self time
# on the calling thread, scaled to its step's CPU time).
# Run from the repository root after a build; about 1 minute (1.5 with a base).
set -eu
if [ $# -gt 2 ]; then
  echo "usage: bench/resnet-passes.sh [BUILD_DIR] [BASE_BUILD_DIR]" >&2
  exit 2
fi
build=${1:-build}
base=${2:-}
for b in $build $base; do
  if [ ! -x "$b/bench/bench-accel" ]; then
    echo "resnet-passes.sh: no $b/bench/bench-accel (build first)" >&2
    exit 2
  fi
done
run() { PRECOND_POOL_STATS=1 "$1/bench/bench-accel" --only resnet --threads 1 --reps "$2" --clock cpu 2>&1; }
passes() {
echo "$2 ($1, 1 thread): CPU ms per step by loop kind"
{ run "$1" 1 | sed 's/^/A /'; run "$1" 10 | sed 's/^/B /'; } |
  awk '$5 == "step" && $1 == "B" { step = $6 }
       $2 == "pool-stats" && $4 ~ /^[0-9]+$/ && $3 != "gemm_slice" {
         sg = $1 == "A" ? -1 : 1; cpu[$3] += sg * $10; ph[$3] += sg * $9 }
       END {
         tot = 0; for (k in cpu) if (k !~ /:/) tot += cpu[k];
         printf "  step CPU median %.1f ms; the loops %.1f ms per step (9 steps)\n", step, tot / 9;
         for (k in cpu) if (k !~ /:/ && cpu[k] / 9 >= 0.05) {
           s = ph[k ":pack"] + ph[k ":kernel"] + ph[k ":copyout"] + ph[k ":scatter"];
           printf "  %-24s %7.2f ms %5.1f%%", k, cpu[k] / 9, 100 * cpu[k] / tot;
           if (s > 0) printf "   packing %4.1f%% products %4.1f%% copy-out %4.1f%%", 100 * ph[k ":pack"] / s,
                             100 * ph[k ":kernel"] / s, 100 * (ph[k ":copyout"] + ph[k ":scatter"]) / s;
           printf "\n" } }' | sort -k2 -n -r
}
if [ -n "$base" ]; then passes "$base" base; fi
passes "$build" ours
echo "PyTorch (torch-keep, 1 thread): CPU ms per step by op"
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967295 \
  /usr/bin/python3 bench/reference/resnet_torch.py --threads 1 --reps 10 --clock cpu --profile |
  awk '$1 == "model" && $(NF-4) == "step" { step = $(NF-3) }
       $1 == "profile" && $NF ~ /^[0-9.]+$/ && $(NF-1) ~ /%$/ { sh = $(NF-1); sub("%", "", sh);
         printf "  %-40s %7.2f ms %5.1f%%\n", $2, step * sh / 100, sh }
       END { printf "  step CPU median %.1f ms\n", step }'
