#!/bin/sh
# resnet-passes.sh -- the ResNet-20 training step's CPU time by pass, ours against PyTorch's,
# on 1 thread (no spinning threads, no split: each pass's own cost), for issue 13 part 3.
#
#   bench/resnet-passes.sh [BUILD_DIR]                                   (default: build)
#
# Ours: bench-accel --only resnet with PRECOND_POOL_STATS=1, a run of 11 steps minus a run
# of 2 (the first step's page faults and the pool stats' start-up drop out): CPU ms per step
# of every loop kind, and for the direct convs the shares of their phases (packing, products,
# copy-out; wall time within the loop). "c3_fwd_part" is the forward convs (their outputs'
# moments made in the copy-out), "c3_lanes_part" those of stages 2-3 in the lanes layout
# (session 13; stage 1 and the stride-2 convs stay in c3_fwd_part), "c3_fwd_part.nomoments"
# the stride-1 input gradients (a conv of dy; the residual's add in the copy-out),
# "c3_dgrad_part" the stride-2 input gradients, "c3_wgrad_part" the weight gradients.
# PyTorch: bench/reference/resnet_torch.py --profile (each op's self time on the calling
# thread, scaled to its step's CPU time).
# Run from the repository root after a build; about 1 minute.
set -eu
build=${1:-build}
run() { PRECOND_POOL_STATS=1 "$build/bench/bench-accel" --only resnet --threads 1 --reps "$1" --clock cpu 2>&1; }
echo "ours ($build, 1 thread): CPU ms per step by loop kind"
{ run 1 | sed 's/^/A /'; run 10 | sed 's/^/B /'; } |
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
echo "PyTorch (torch-keep, 1 thread): CPU ms per step by op"
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967295 \
  /usr/bin/python3 bench/reference/resnet_torch.py --threads 1 --reps 10 --clock cpu --profile |
  awk '$1 == "model" && $(NF-4) == "step" { step = $(NF-3) }
       $1 == "profile" && $NF ~ /^[0-9.]+$/ && $(NF-1) ~ /%$/ { sh = $(NF-1); sub("%", "", sh);
         printf "  %-40s %7.2f ms %5.1f%%\n", $2, step * sh / 100, sh }
       END { printf "  step CPU median %.1f ms\n", step }'
