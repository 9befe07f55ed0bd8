#!/bin/bash
# Shampoo's worker step CPU on W1 (issue 8: at most 1.10x AdamW's), AdamW and Shampoo of
# build/ and Shampoo of the BASE build (another build directory) alternated, 150 steps
# each, one precondd --threads 1 per build. Run from the repository root with build/
# built; about 2.5 minutes on quiet cores (3 with --parts).
# usage: bash bench/w1-step-cpu.sh BASE [--parts | --pool]
# Figures: median cpu_ms and opt_cpu_ms of rows 11-150 per run, the median of their
# difference (model_cpu_ms: the forward and backward, data and the process's other threads
# while they run), and the staleness mean; then Shampoo / AdamW of the medians per pair.
# --parts adds two Shampoo runs of build/ that take precondd's work away step by step:
# shampoo-idle (--root-every 100000: statistics pushed and folded every step, roots computed
# only once per block, so precondd's root worker is idle) and shampoo-nostat (--stat-every
# 100000: no statistics, no pushes after step 1; the step applies the first roots). Their
# model_cpu_ms against shampoo's and adamw's says how much of the extra comes from precondd
# working on the other core and how much from the worker process itself.
# --pool runs instead, after a first AdamW / Shampoo pair: shampoo-nice (precondd --pool-nice
# 19: the root workers below the worker's threads where they share a core) and
# shampoo-every2 (--root-every 2: half the roots, each block's every other push), alternated
# with Shampoo and AdamW (about 3.5 minutes on quiet cores).
# thread_cpu_ms is the training thread's own CPU (train.csv's thread_cpu_ms); others_ms the
# median of cpu_ms - thread_cpu_ms (libprecond's thread and any other of the process), so
# the pair lines' "thread" ratio is the model and optimizer without the client's thread.
set -u
mode=
[ $# -eq 2 ] && { [ "$2" = --parts ] || [ "$2" = --pool ]; } && mode=$2
{ [ $# -eq 1 ] || [ -n "$mode" ]; } && [ -x "$1/bench/transformer" ] ||
  { echo "usage: bash bench/w1-step-cpu.sh BASE [--parts | --pool] (BASE: a build directory with bench/transformer)" >&2; exit 2; }
A=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
B=build; T=$(mktemp -d)
C="--lr 3e-3 --steps 150 --eval-every 50 --eval-batches 8 --seed 1 --backend cpu --quiet"
$B/host/precondd --listen unix:$T/s --state-dir $T/st --threads 1 --snapshot-interval 60 --log-level warn & d=$!
$A/host/precondd --listen unix:$T/sb --state-dir $T/stb --threads 1 --snapshot-interval 60 --log-level warn & db=$!
dn=$d
[ "$mode" = --pool ] && { $B/host/precondd --listen unix:$T/sn --state-dir $T/stn --threads 1 --snapshot-interval 60 --log-level warn --pool-nice 19 & dn=$!; }
sleep 1
# med FILE EXPR: the median over rows 11-150 of an awk expression of the row's fields.
med() { awk -F, "NR > 11 && \$10 != \"\" { print $2 }" $1 | sort -g | awk '{ a[NR] = $1 } END { print (a[int((NR + 1) / 2)] + a[int(NR / 2) + 1]) / 2 }'; }
# thr FILE EXPR: med where train.csv has thread_cpu_ms (builds before session 15: "-").
thr() { if head -1 $1 | grep -q thread_cpu_ms; then med $1 "$2"; else echo -; fi; }
runs="adamw:1 shampoo:1 shampoo-base:1 adamw:2 shampoo-base:2 shampoo:2"
[ "$mode" = --parts ] && runs="$runs shampoo-idle:3 shampoo-nostat:3 adamw:3"
[ "$mode" = --pool ] && runs="adamw:1 shampoo:1 shampoo-nice:1 shampoo-every2:1 adamw:2 shampoo-every2:2 shampoo-nice:2 shampoo:2"
for r in $runs; do
  n=${r%%:*} k=${r##*:} bin=$B sock=$T/s extra=""
  [ "$n" = shampoo-base ] && bin=$A && sock=$T/sb
  [ "$n" = shampoo-idle ] && extra="--root-every 100000"
  [ "$n" = shampoo-nostat ] && extra="--stat-every 100000"
  [ "$n" = shampoo-nice ] && sock=$T/sn
  [ "$n" = shampoo-every2 ] && extra="--root-every 2"
  o=${n%-*}
  OPENBLAS_NUM_THREADS=1 $bin/bench/transformer --daemon unix:$sock --out $T/$n$k --job $n$k --optimizer $o $C $extra > /dev/null
  f=$T/$n$k/train.csv
  echo "$n $k median cpu_ms $(med $f '$10') opt_cpu_ms $(med $f '$12') model_cpu_ms $(med $f '$10 - $12') thread_cpu_ms $(thr $f '$13') others_ms $(thr $f '$10 - $13') staleness $(sed -n 's/.*"staleness_mean": *\([0-9.]*\).*/\1/p' $T/$n$k/summary.json)"
done | tee $T/rows
# Shampoo / AdamW per pair: each Shampoo run against the AdamW run of its pair.
awk '{ cpu[$1 " " $2] = $5; model[$1 " " $2] = $9; thr[$1 " " $2] = $11 }
  END { for (k = 1; k <= 3; k++) {
          a = cpu["adamw " k]; m = model["adamw " k]; h = thr["adamw " k]; if (a == "") continue
          split("shampoo shampoo-base shampoo-idle shampoo-nostat shampoo-nice shampoo-every2", s, " ")
          for (i = 1; i <= 6; i++) if ((s[i] " " k) in cpu)
            printf "pair %d %s / adamw: step cpu %.3fx, model cpu %.3fx, thread %s\n", k, s[i],
                   cpu[s[i] " " k] / a, model[s[i] " " k] / m,
                   thr[s[i] " " k] == "-" ? "-" : sprintf("%.3fx", thr[s[i] " " k] / h) } }' $T/rows
kill $d $db $dn 2>/dev/null; wait $d $db $dn 2>/dev/null; rm -rf $T
