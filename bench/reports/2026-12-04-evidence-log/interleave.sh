#!/bin/bash
# Interleaved before/after drains: PAIRS pairs (default 12), the order alternating per pair,
# one mock repetition of `python -m bench drain` each, run from each tree's root so that
# tree's service and migrations are measured. Usage: interleave.sh OUT_DIR
set -u
OUT=${1:?output folder}
PAIRS=${PAIRS:-12}
BEFORE=${BEFORE:-/tmp/sweeper-before}
AFTER=${AFTER:-/tmp/sweeper-after}
URL=${SWEEPER_BENCH_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/postgres}
PY=${PY:-/work/wt-evidence/.venv/bin/python}
mkdir -p "$OUT"
for i in $(seq 1 "$PAIRS"); do
  if [ $((i % 2)) -eq 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ "$side" = before ]; then dir=$BEFORE; else dir=$AFTER; fi
    (cd "$dir" && SWEEPER_BENCH_DATABASE_URL=$URL $PY -m bench drain --items 20000 \
      --repeat 1 --concurrency 16,64 --modes mock --no-profile --no-log-compare \
      --no-explain --json-out "$OUT/$side-$i.json") > "$OUT/$side-$i.log" 2>&1
  done
done
