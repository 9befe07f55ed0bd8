#!/bin/sh
# long_run.sh [BUILD] [SECONDS] [CLIENTS] -- the long runs of the load client (load_client.c)
# against BUILD/host/precondd (BUILD defaults to build): CLIENTS (64) clients for SECONDS
# (600), every root checked and the daemon's RSS sampled each second, then the kill -9
# harness (3 kills, 10 s of training before each, snapshots every 5 s). Both niced; their
# key=value lines go to stdout and to $OUT (default out/load): load.txt, rss.csv, kill9.txt.
# Exits non-zero if either run fails (an error, a root that differs, versions that went
# backwards, a restart the client was not told).
set -eu
build=${1:-build}
secs=${2:-600}
clients=${3:-64}
out=${OUT:-out/load}
mkdir -p "$out"
status=0
nice -n 10 "$build/tests/load/load-client" --spawn "$build/host/precondd" --clients "$clients" \
  --seconds "$secs" --rss-csv "$out/rss.csv" > "$out/load.txt" || status=1
cat "$out/load.txt"
nice -n 10 "$build/tests/load/load-client" --spawn "$build/host/precondd" --kill9 3 --seconds 10 \
  --snapshot-s 5 > "$out/kill9.txt" || status=1
cat "$out/kill9.txt"
exit $status
