#!/usr/bin/env bash
# bench/main-job.sh -- precond's main job: the Transformer comparison (AdamW vs Shampoo with
# roots from precondd) at the training protocol users expect (linear warm-up, then cosine
# decay to 0 over the run; each optimizer's defaults from the clients' table), with a
# learning-rate sweep of the same size per optimizer, 1000 steps a run: about 7 minutes on
# 2 idle cores.
#
# Starts precondd on a unix socket with a temporary state directory, runs bench/compare for
# the byte-level Transformer on the King James Bible, shows what the daemon is doing with
# precondctl while the runs go, prints the results table, names the plot files, and stops
# the daemon. Run it from the repository root after building (meson compile -C build).
set -u

usage() {
  cat <<'EOF'
Usage: bench/main-job.sh [--build DIR] [--out DIR] [--steps N] [--every S] [--help]

  --build DIR   the Meson build directory (default $PRECOND_BUILD or ./build)
  --out DIR     results directory (default out/main-job)
  --steps N     step budget of every run (default 1000)
  --every S     seconds between precondctl reports while training (default 60)
Any other options go to bench/compare (e.g. --lrs-adamw 1e-3,3e-3 --lrs-shampoo 1e-3,3e-3;
the defaults are the sweeps below).
EOF
}

die() { echo "main-job: $*" >&2; exit 2; }

build="${PRECOND_BUILD:-build}" out="out/main-job" steps=1000 every=60
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --help|-h) usage; exit 0 ;;
    --build|--out|--steps|--every)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --build) build=$2 ;; --out) out=$2 ;; --steps) steps=$2 ;; --every) every=$2 ;;
      esac
      shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
case "$every" in ''|*[!0-9]*|0) die "--every '$every' is not a positive integer" ;; esac
case "$steps" in ''|*[!0-9]*|0) die "--steps '$steps' is not a positive integer" ;; esac

here=$(cd "$(dirname "$0")" && pwd)
precondd="$build/host/precondd" precondctl="$build/client/precondctl"
for b in "$precondd" "$precondctl" "$build/bench/transformer"; do
  [ -x "$b" ] || die "$b not found: build first (meson setup build && meson compile -C build)"
done

# The daemon: a unix socket in a private temporary directory, its state next to it.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/precond-main-job.XXXXXX") || die "mktemp failed"
addr="unix:$tmp/precondd.sock"
daemon_pid="" compare_pid=""
cleanup() {
  [ -n "$compare_pid" ] && kill -TERM "$compare_pid" 2>/dev/null
  if [ -n "$daemon_pid" ]; then
    kill -TERM "$daemon_pid" 2>/dev/null
    wait "$daemon_pid" 2>/dev/null
    echo "main-job: precondd stopped" >&2
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$out" || die "cannot create $out"
"$precondd" --listen "$addr" --state-dir "$tmp/state" --threads 1 --snapshot-interval 60 \
  --log-level warn 2>"$out/precondd.log" &
daemon_pid=$!
for _ in $(seq 100); do
  "$precondctl" --addr "$addr" --timeout 500 health >/dev/null 2>&1 && break
  kill -0 "$daemon_pid" 2>/dev/null || die "precondd exited (see $out/precondd.log)"
  sleep 0.1
done
"$precondctl" --addr "$addr" health >&2 || die "precondd is not serving (see $out/precondd.log)"
echo "main-job: precondd (pid $daemon_pid) at $addr, state in $tmp/state" >&2

# The comparison: AdamW and Shampoo, the same two learning rates each (around each one's best:
# AdamW's 1e-3 and Shampoo's 1e-3 lost to 3e-3 in earlier main jobs; AdamW's 6e-3 loses to its
# 3e-3 and Shampoo's 6e-3 wins over its 3e-3, docs/optimizers.md), same seed and budget, on the
# default model (context 64, d_model 128, 4 heads, 2 layers, batch 32, untied head), every run
# at the clients' protocol.
# Evaluations every twentieth of the run, so "steps to AdamW's final loss" resolves 0.05x.
OPENBLAS_NUM_THREADS=1 "$here/compare" --model transformer --out "$out" --build "$build" \
  --daemon "$addr" --steps "$steps" --eval-every $(( steps / 20 > 0 ? steps / 20 : 1 )) \
  --lrs-adamw 3e-3,6e-3 --lrs-shampoo 3e-3,6e-3 "${extra[@]}" \
  -- --eval-batches 8 >"$out/compare.out" &
compare_pid=$!

# What the daemon sees while the runs go.
start=$(date +%s)
while kill -0 "$compare_pid" 2>/dev/null; do
  for _ in $(seq "$every"); do
    kill -0 "$compare_pid" 2>/dev/null || break
    sleep 1
  done
  kill -0 "$compare_pid" 2>/dev/null || break
  echo "--- precondctl stats at $(( $(date +%s) - start )) s ---" >&2
  "$precondctl" --addr "$addr" stats >&2 || echo "main-job: precondctl stats failed" >&2
done
wait "$compare_pid"
rc=$?
compare_pid=""
echo "--- precondctl stats at the end ($(( $(date +%s) - start )) s) ---" >&2
"$precondctl" --addr "$addr" stats >&2
job=$("$precondctl" --addr "$addr" stats --json 2>/dev/null |
      sed -n 's/.*"job": *"\(compare-transformer-shampoo[^"]*\)".*/\1/p' | tail -n 1)
if [ -n "$job" ]; then
  echo "--- precondctl blocks --job $job ---" >&2
  "$precondctl" --addr "$addr" --job "$job" blocks >&2
fi

echo
cat "$out/compare.out"
echo
echo "Plots: $out/loss-vs-step.png $out/loss-vs-time.png"
echo "Table: $out/results.md (and results.csv); per run: $out/runs/*/{train.csv,summary.json}"
exit $rc
