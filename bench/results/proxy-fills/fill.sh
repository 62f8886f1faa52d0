#!/bin/bash
# usage: fill.sh BINARY STORE(lmdb|memory) [strace]: cacheable misses at 8 connections
BIN=$1; S=$2
cd /tmp/pp
rm -rf cache; mkdir cache
cat > f.toml <<T
listen = "127.0.0.1:18080"
backends = ["127.0.0.1:18081"]
[cache]
backend = "$S"
path = "/tmp/pp/cache"
capacity_bytes = 4294967296
T
(cd /work/main && /var/cache/inband/target-venv/bin/python -m bench.lib.origin --listen 127.0.0.1:18081 --object-bytes 10240 > /tmp/pp/origin.log 2>&1 &)
INBAND_LOG=warn $BIN proxy --config f.toml > proxy.log 2>&1 &
PP=$!
sleep 1.5
wrk -t1 -c8 -d2s -s fill.lua http://127.0.0.1:18080/ > /dev/null
if [ "$3" = strace ]; then
  wrk -t1 -c8 -d6s -s fill.lua http://127.0.0.1:18080/ > w.txt &
  W=$!; sleep 1; timeout -s INT 3 strace -c -f -p $PP -o strace.txt; wait $W
  echo "futex $(awk '$NF=="futex"{print $4}' strace.txt) writev $(awk '$NF=="writev"{print $4}' strace.txt)"
else
  for i in 1 2 3; do
    t0=$(awk '{print $14+$15}' /proc/$PP/stat)
    r=$(wrk -t1 -c8 -d5s -s fill.lua http://127.0.0.1:18080/ | awk '/Requests\/sec/{print $2}')
    t1=$(awk '{print $14+$15}' /proc/$PP/stat)
    echo "rps $r cpu_us_per_req $(python3 -c "print(round(($t1-$t0)*10000/($r*5),1))")"
  done
fi
kill -9 $PP; pkill -f "bench.lib.origin --listen 127.0.0.1:18081" || true
sleep 0.5
