#!/bin/bash
# interleaved A B loopback drains: A = 4617abd (/work/ab-old), B = HEAD (/work/main)
for i in 1 2 3 4 5 6; do
  for side in old main; do
    cd /work/ab-$side 2>/dev/null || cd /work/main
    .venv/bin/python -m bench drain --modes loopback --concurrency 16,64,256 --items 20000 --loopback-items 20000 --repeat 1 \
      --no-profile --no-log-compare --no-explain --log-level WARNING \
      --database-url postgresql://postgres@127.0.0.1:5432/postgres --json-out /tmp/ab/H-$side-$i.json > /tmp/ab/H-$side-$i.log 2>&1
    echo "$side $i rc=$? $(date +%T)"
  done
done
