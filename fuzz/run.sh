#!/bin/sh
# run.sh HARNESS [SECONDS] -- runs one libFuzzer harness (a fuzz_NAME binary of a
# -Dfuzz=enabled build) for SECONDS (default 20) over its seed corpus fuzz/corpus/NAME,
# which is read, never written: new inputs go to HARNESS's directory, corpus-NAME/, and
# crashes to crash-NAME/ next to it. Exits non-zero on a crash, a leak, an OOM (above
# 2 GiB RSS) or a timeout (FUZZ_TIMEOUT seconds for one input, default 10), printing the
# executions libFuzzer reports. The timeout is wall-clock: a run at nice 19 on a loaded
# machine can be starved for longer than 10 s and report a false timeout (an input that
# then runs in milliseconds), so long runs there take FUZZ_TIMEOUT=60. FUZZ_RUNS=N stops
# after N executions (whichever of N and SECONDS comes first), for an execution target.
# A crash found becomes a regression test: add the input to fuzz/corpus/NAME (then every
# run replays it) and a unit test in tests/ for the fix.
#
#   CC=clang-14 meson setup build-fuzz -Dfuzz=enabled -Db_sanitize=address,undefined \
#       -Db_lundef=false -Dcuda=disabled -Dtests=disabled
#   meson compile -C build-fuzz && fuzz/run.sh build-fuzz/fuzz/fuzz_service 3600
set -eu
exe=$1
secs=${2:-20}
name=$(basename "$exe" | sed 's/^fuzz_//')
here=$(cd "$(dirname "$0")" && pwd)
work=$(dirname "$exe")
mkdir -p "$work/corpus-$name" "$work/crash-$name"
exec "$exe" -max_total_time="$secs" -rss_limit_mb=2048 -timeout="${FUZZ_TIMEOUT:-10}" \
  -print_final_stats=1 ${FUZZ_RUNS:+-runs="$FUZZ_RUNS"} \
  -artifact_prefix="$work/crash-$name/" "$work/corpus-$name" "$here/corpus/$name"
