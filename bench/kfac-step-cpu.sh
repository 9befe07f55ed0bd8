#!/bin/bash
# K-FAC's worker step CPU on the Transformer (the product target: at most 1.15x AdamW's),
# AdamW and K-FAC of build/ and K-FAC of the BASE build (another build directory)
# alternated, 150 steps each at the main job's settings (bench/main-job.sh: K-FAC at lr 0.1,
# AdamW at 3e-3, asynchronous inverses), one precondd --threads 1 per build. Run from the
# repository root with build/ built; about 2.5 minutes on quiet cores.
# usage: bash bench/kfac-step-cpu.sh BASE
# Figures: median cpu_ms (the process's CPU per step, all threads) and opt_cpu_ms of rows
# 11-150 per run, the median opt_cpu_ms of the steps 10 k + 1 among them (where new inverses
# used to be taken in: "spike"), the mean cpu_ms (the Transformer's K-FAC takes factors
# every other step: two modes, which the median falls between; rows without an evaluation),
# the staleness mean, then K-FAC / AdamW per pair (run r of each), by medians and by means.
set -u
[ $# -eq 1 ] && [ -x "$1/bench/transformer" ] && [ -x "$1/host/precondd" ] ||
  { echo "usage: bash bench/kfac-step-cpu.sh BASE (a build directory with bench/transformer)" >&2; exit 2; }
A=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
B=build; T=$(mktemp -d)
[ -x $B/bench/transformer ] || { echo "kfac-step-cpu: build/ is not built" >&2; exit 2; }
C="--steps 150 --eval-every 50 --eval-batches 8 --seed 1 --backend cpu --quiet"
$B/host/precondd --listen unix:$T/s --state-dir $T/st --threads 1 --snapshot-interval 60 --log-level warn & d=$!
$A/host/precondd --listen unix:$T/sb --state-dir $T/stb --threads 1 --snapshot-interval 60 --log-level warn & db=$!
trap 'kill $d $db 2>/dev/null; wait $d $db 2>/dev/null; rm -rf $T' EXIT
sleep 1
mean() { awk -F, -v c=$2 'NR > 11 && $c != "" && $5 == "" { s += $c; n++ } END { print s / n }' $1; }
med() { awk -F, -v c=$2 -v m=${3:-1} 'NR > 11 && $c != "" && ($1 % 10 == 1 || m) { print $c }' $1 | sort -g | awk '{ a[NR] = $1 } END { print (a[int((NR + 1) / 2)] + a[int(NR / 2) + 1]) / 2 }'; }
for r in adamw:1 kfac:1 kfac-base:1 adamw:2 kfac-base:2 kfac:2; do
  n=${r%%:*} i=${r##*:} bin=$B sock=$T/s lr=0.1
  [ "$n" = kfac-base ] && bin=$A && sock=$T/sb
  [ "$n" = adamw ] && lr=3e-3
  OPENBLAS_NUM_THREADS=1 $bin/bench/transformer --daemon unix:$sock --out $T/$n$i --job $n$i \
    --optimizer ${n%-base} --lr $lr $C > $T/$n$i.log 2>&1 ||
    { echo "kfac-step-cpu: $n $i failed:" >&2; tail -n 3 $T/$n$i.log >&2; exit 1; }
  f=$T/$n$i/train.csv
  c=$(med $f 10) m=$(mean $f 10); eval "cpu_${n/-/_}_$i=$c mcpu_${n/-/_}_$i=$m"
  echo "$n $i median cpu_ms $c mean $m opt_cpu_ms $(med $f 12) spike $(med $f 12 0) staleness $(sed -n 's/.*"staleness_mean": *\([0-9.]*\).*/\1/p' $T/$n$i/summary.json)"
done
for i in 1 2; do
  eval "a=\$cpu_adamw_$i k=\$cpu_kfac_$i kb=\$cpu_kfac_base_$i"
  awk -v a=$a -v k=$k -v kb=$kb -v i=$i 'BEGIN { printf "pair %d: kfac / adamw %.3fx, base kfac / adamw %.3fx, kfac / base kfac %.3fx\n", i, k / a, kb / a, k / kb }'
  eval "a=\$mcpu_adamw_$i k=\$mcpu_kfac_$i kb=\$mcpu_kfac_base_$i"
  awk -v a=$a -v k=$k -v kb=$kb -v i=$i 'BEGIN { printf "pair %d by means: kfac / adamw %.3fx, base kfac / adamw %.3fx, kfac / base kfac %.3fx\n", i, k / a, kb / a, k / kb }'
done
