#!/bin/bash
# usage: misses-ab.sh NAME=BINARY NAME=BINARY ROUNDS
# Pass-through misses (a new /pass/ path per request, answered no-store by
# an nginx origin serving one 10,240-byte file), wrk -t1 -c8 for 5 s after
# 1 s of warm-up, the two builds alternated A B B A ...; prints per window
# the build, misses a second and the proxy's CPU µs per miss (utime +
# stime of its process from /proc, all threads).
set -e
D=$(cd "$(dirname "$0")" && pwd)
A=$1; B=$2; N=${3:-3}
mkdir -p $D/ngo/root; head -c 10240 /dev/zero | tr '\0' 'x' > $D/ngo/root/pass-body
cat > $D/ngo/o.conf <<T
worker_processes 1;
pid $D/ngo/nginx.pid;
error_log $D/ngo/error.log warn;
events { worker_connections 1024; }
http {
    access_log off; sendfile on; tcp_nopush on; keepalive_requests 1000000;
    open_file_cache max=10000 inactive=60s; default_type application/octet-stream;
    server { listen 127.0.0.1:18181; root $D/ngo/root;
        location /pass/ { add_header Cache-Control "no-store" always; try_files /pass-body =500; } }
}
T
cat > $D/p.toml <<T
listen = "127.0.0.1:18180"
backends = ["127.0.0.1:18181"]
[cache]
backend = "lmdb"
path = "$D/cache"
capacity_bytes = 1073741824
T
cat > $D/pass.lua <<'T'
local n = 0
request = function() n = n + 1; return wrk.format("GET", "/pass/" .. math.random(1, 1000000000) .. "-" .. n) end
T
nginx -c $D/ngo/o.conf -p $D/ngo -g "daemon on;"
trap 'kill $(cat $D/ngo/nginx.pid) 2>/dev/null || true' EXIT
ticks() { awk '{print $14+$15}' /proc/$1/stat; }
HZ=$(getconf CLK_TCK)
for i in $(seq 1 $N); do
  for which in A B B A; do
    spec=${!which}; name=${spec%%=*}; bin=${spec#*=}
    rm -rf $D/cache; mkdir $D/cache
    INBAND_LOG=warn $bin proxy --config $D/p.toml > $D/proxy.log 2>&1 &
    P=$!; sleep 1
    wrk -t1 -c8 -d1s -s $D/pass.lua http://127.0.0.1:18180/ > /dev/null
    t0=$(ticks $P)
    out=$(wrk -t1 -c8 -d5s -s $D/pass.lua http://127.0.0.1:18180/)
    t1=$(ticks $P)
    kill $P; wait $P 2>/dev/null || true
    reqs=$(echo "$out" | awk '/requests in/{print $1}')
    rps=$(echo "$out" | awk '/Requests\/sec/{print $2}')
    echo "$name $rps $(awk -v t=$((t1-t0)) -v hz=$HZ -v r=$reqs 'BEGIN{printf "%.1f", t/hz/r*1e6}')"
  done
done
