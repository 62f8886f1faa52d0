#!/bin/bash
# usage: conns-ab.sh NAME=BINARY NAME=BINARY ROUNDS [CONNECTIONS]
# A new connection per request: wrk -t1 -cC with "Connection: close" for
# 5 s after 1 s of warm-up, every request a cache hit of one 1,024-byte
# object (memory store; the nginx origin answers it once), the two builds
# alternated A B B A ...; prints per window the build, requests (and so
# connections) a second and the proxy's CPU µs per connection (utime +
# stime of its process from /proc, all threads).
set -e
D=$(cd "$(dirname "$0")" && pwd)
A=$1; B=$2; N=${3:-3}; C=${4:-8}; H=(-H "Connection: close"); [ "${5:-}" != keep ] || H=()
W=$(mktemp -d); chmod 755 $W
trap 'kill $(cat $W/nginx.pid) 2>/dev/null || true; rm -rf $W' EXIT
mkdir -p $W/root; head -c 1024 /dev/zero | tr '\0' 'x' > $W/root/obj
cat > $W/o.conf <<T
worker_processes 1;
pid $W/nginx.pid;
error_log $W/error.log warn;
events { worker_connections 1024; }
http {
    access_log off; default_type application/octet-stream;
    server { listen 127.0.0.1:18191; root $W/root;
        location / { add_header Cache-Control "max-age=3600" always; } }
}
T
cat > $W/p.toml <<T
listen = "127.0.0.1:18190"
backends = ["127.0.0.1:18191"]
[cache]
backend = "memory"
capacity_bytes = 67108864
T
nginx -c $W/o.conf -p $W -g "daemon on;"
ticks() { awk '{print $14+$15}' /proc/$1/stat; }
HZ=$(getconf CLK_TCK)
for i in $(seq 1 $N); do
  for which in A B B A; do
    spec=${!which}; name=${spec%%=*}; bin=${spec#*=}
    INBAND_LOG=warn $bin proxy --config $W/p.toml > $W/proxy.log 2>&1 &
    P=$!; sleep 1
    wrk -t1 -c$C -d1s "${H[@]}" http://127.0.0.1:18190/obj > /dev/null
    t0=$(ticks $P)
    out=$(wrk -t1 -c$C -d5s "${H[@]}" http://127.0.0.1:18190/obj)
    t1=$(ticks $P)
    kill $P; wait $P 2>/dev/null || true
    reqs=$(echo "$out" | awk '/requests in/{print $1}')
    rps=$(echo "$out" | awk '/Requests\/sec/{print $2}')
    errs=$(echo "$out" | awk '/Non-2xx|Socket errors/{print}' | tr '\n' ' ')
    echo "$name $rps $(awk -v t=$((t1-t0)) -v hz=$HZ -v r=$reqs 'BEGIN{printf "%.1f", t/hz/r*1e6}') $errs"
  done
done
