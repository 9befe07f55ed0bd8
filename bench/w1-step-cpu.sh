#!/bin/bash
# Shampoo's worker step CPU on W1 (issue 8: at most 1.10x AdamW's), AdamW and Shampoo of
# build/ and Shampoo of the BASE build (another build directory) alternated, 150 steps
# each, one precondd --threads 1 per build. Run from the repository root with build/
# built; about 2.5 minutes on quiet cores. usage: bash bench/w1-step-cpu.sh BASE
# Figures: median cpu_ms and opt_cpu_ms of rows 11-150 per run, and the staleness mean.
set -u
[ $# -eq 1 ] && [ -x "$1/bench/transformer" ] ||
  { echo "usage: bash bench/w1-step-cpu.sh BASE (a build directory with bench/transformer)" >&2; exit 2; }
A=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
B=build; T=$(mktemp -d)
C="--lr 3e-3 --steps 150 --eval-every 50 --eval-batches 8 --seed 1 --backend cpu --quiet"
$B/host/precondd --listen unix:$T/s --state-dir $T/st --threads 1 --snapshot-interval 60 --log-level warn & d=$!
$A/host/precondd --listen unix:$T/sb --state-dir $T/stb --threads 1 --snapshot-interval 60 --log-level warn & db=$!
sleep 1
med() { awk -F, -v c=$2 'NR > 11 && $c != "" { print $c }' $1 | sort -g | awk '{ a[NR] = $1 } END { print (a[int((NR + 1) / 2)] + a[int(NR / 2) + 1]) / 2 }'; }
for r in adamw:1 shampoo:1 shampoo-base:1 adamw:2 shampoo-base:2 shampoo:2; do
  n=${r%%:*}; bin=$B; sock=$T/s
  [ "$n" = shampoo-base ] && bin=$A && sock=$T/sb
  OPENBLAS_NUM_THREADS=1 $bin/bench/transformer --daemon unix:$sock --out $T/$n${r##*:} --job $n${r##*:} --optimizer ${n%-base} $C > /dev/null
  f=$T/$n${r##*:}/train.csv
  echo "$n ${r##*:} median cpu_ms $(med $f 10) opt_cpu_ms $(med $f 12) staleness $(sed -n 's/.*"staleness_mean": *\([0-9.]*\).*/\1/p' $T/$n${r##*:}/summary.json)"
done
kill $d $db; wait $d $db 2>/dev/null; rm -rf $T
