#!/bin/bash
for i in 1 2 3 4; do
  for side in old main; do
    if [ $side = old ]; then cd /work/ab-old; else cd /work/main; fi
    /work/main/.venv/bin/python -m bench drain --modes loopback --concurrency 64,256 --items 20000 --loopback-items 20000 --repeat 1 \
      --no-profile --no-log-compare --no-explain --log-level WARNING \
      --database-url postgresql://postgres@127.0.0.1:5432/postgres --json-out /tmp/gc/G-$side-$i.json > /tmp/gc/G-$side-$i.log 2>&1
    echo "$side $i rc=$? $(date +%T)"
  done
done
