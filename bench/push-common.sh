# Sourced by bench/push-xcore.sh, bench/push-lib.sh and bench/fold-xcore.sh once they set
# base (the BASE build directory, absolute): moves to the repository root, checks build/, and makes $tmp (removed
# at exit) with $tmp/pd1-base.sh and $tmp/pd1-new.sh, each build's precondd pinned to core 1.
cd "$(dirname "$0")/.." || exit 2
[ -x build/bench/bench-daemon ] && [ -x build/host/precondd ] ||
  { echo "build first: meson compile -C build" >&2; exit 2; }
export OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for v in base new; do
  if [ $v = base ]; then p=$base/host/precondd; else p=$PWD/build/host/precondd; fi
  printf '#!/bin/sh\nexec taskset -c 1 %s "$@"\n' "$p" > "$tmp/pd1-$v.sh"
  chmod +x "$tmp/pd1-$v.sh"
done
