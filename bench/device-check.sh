#!/bin/bash
# device-check.sh -- the one prepared script for a GPU machine (budget: under 8 minutes).
#
#   1. builds the project with -Dcuda=enabled into build-cuda (nvcc for sm_80 and sm_90);
#   2. runs the whole accel suite with AC_REQUIRE_CUDA=1, so every CUDA-vs-CPU test must run
#      (a missing device is a failure, not a skip): backend primitives, tensors, layers,
#      models, the optimizers (Shampoo's worker, K-FAC) and ABS's Hessian-vector products
#      (test_abs). The CPU backend's direct and stride-2 conv kernels have no CUDA version:
#      on CUDA the layers use im2col + gemm, which these tests compare against the CPU; nor
#      have their session-10 variants (batch norm's moments made while the conv writes y,
#      the residual gradient added while it writes dx): on CUDA batch norm takes its own
#      pass and the block its own sum (test_conv_bn_moments runs in the CUDA group too);
#      nor have session 11's CPU paths (the AVX-512F small-block product and packed syrk of
#      gemm_small.c, the pool's chunks taken dynamically): on CUDA Shampoo's and K-FAC's
#      block products stay on cuBLAS, which test_sgemm_small_blocks and
#      test_syrk_small_blocks check against a double reference in the CUDA group too;
#      session 12 added no kernel (its changes are the CPU backend's AVX-512F tails and
#      packing, the daemon's root rate and the shared region's doorbell); session 13's
#      lanes layout (accel/conv_lanes.c) and batch norm's sums made by the conv that writes
#      its gradient (ac_conv3x3_bn_grad, ac_conv_s2_dgrad_bn) are CPU-only: on CUDA those
#      calls answer unsupported and the layers take batch norm's own passes, which
#      test_conv_bn_grad (fused against unfused, in the CUDA group too) checks; session 14
#      added no kernel: K-FAC's preconditioning sums k in chunks of at most 256 (on CUDA a
#      few more cuBLAS calls of the same products: test_precondition at orders past 256 in
#      the CUDA group), the packed syrk's larger orders and the 1 x 1 product by cblas_sdot
#      are the CPU backend's own, and ac_kfac_dense_factors_to_host writes the factors into
#      host memory (on CUDA through ac_syrk_packed_to_host's download, which
#      test_syrk_packed_to_host checks in the CUDA group; the trainer's test of the slots,
#      test_kfac_worker_forms, runs on the CPU backend only); session 15 added no kernel
#      either: K-FAC's inverses arrive whole from libprecond (kfac_dense), which the CPU
#      trainer reads in place and a CUDA trainer copies onto the device with one
#      ac_memcpy_h2d per side instead of ac_unpack_sym (trainer/kfac.c pt__kfac_take_whole;
#      that CUDA branch has not run on a device, and no test here runs the trainer on CUDA);
#   3. runs the GPU throughput benchmark as CSV: bench-accel when it exists, and the
#      primitives benchmark bench-accel-prims (CPU and CUDA rows side by side).
#
# Usage, from the repository root: sh bench/device-check.sh [OUTDIR]
# OUTDIR (default: $OUT if set, else build-cuda/device-check) receives the test log and the
# CSV files. Exit status: nonzero if the build or any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-${OUT:-build-cuda/device-check}}"
mkdir -p "$out"
jobs="$(nproc 2>/dev/null || echo 4)"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-4}"
start=$(date +%s)
step() { echo "== $(( $(date +%s) - start ))s: $*"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/device.txt" || true

step "configure and build (-Dcuda=enabled, -j$jobs)"
if [ -d build-cuda ]; then
  meson setup --reconfigure build-cuda -Dcuda=enabled >"$out/configure.log" 2>&1
else
  meson setup build-cuda -Dcuda=enabled >"$out/configure.log" 2>&1
fi
# -k 0: a failure elsewhere in the project must not hide the accel results; the tests below
# run without rebuilding, so an accel target that did not build shows up as a failed test.
build_status=0
ninja -C build-cuda -k 0 -j"$jobs" >"$out/build.log" 2>&1 || build_status=$?
if [ "$build_status" -ne 0 ]; then
  echo "build had failures (status $build_status); failed targets:"
  grep -E "^FAILED" "$out/build.log" | head -20 || true
fi

step "accel suite on CUDA against CPU (AC_REQUIRE_CUDA=1)"
status=0
AC_REQUIRE_CUDA=1 meson test -C build-cuda --no-rebuild --suite accel --print-errorlogs \
  --num-processes "$jobs" --timeout-multiplier 2 >"$out/tests.log" 2>&1 || status=$?
cp build-cuda/meson-logs/testlog.txt "$out/testlog.txt" 2>/dev/null || true
grep -E "^ *[0-9]+/[0-9]+ " "$out/tests.log" || true
grep -E "SKIPPED|FAILED" "$out/testlog.txt" | sort | uniq -c | head -40 || true
[ "$status" -eq 0 ] || { echo "accel tests FAILED (see $out/tests.log)"; tail -60 "$out/tests.log"; }

step "benchmarks (CSV)"
[ -x build-cuda/bench/bench-accel-prims ] || { echo "bench-accel-prims did not build"; exit 1; }
if [ -x build-cuda/bench/bench-accel ]; then
  build-cuda/bench/bench-accel --csv --backend cuda --chunk 0 --reps 3 | tee "$out/bench-accel.csv" || status=1
fi
build-cuda/bench/bench-accel-prims --backend all --threads "$OPENBLAS_NUM_THREADS" \
  | tee "$out/bench-accel-prims.csv" || status=1

step "done (status $status)"
exit "$status"
