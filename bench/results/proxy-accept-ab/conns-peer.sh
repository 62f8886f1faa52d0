#!/bin/bash
# usage: conns-peer.sh ROUNDS CONNECTIONS NAME=BINARY...
# The workload of conns-ab.sh (a new connection per request, every request
# a cache hit of one 1,024-byte object) served in turn by `inband proxy`
# (memory store) and by nginx proxy_cache (one worker per CPU, its cache
# in a directory of its own), each round in one order and then the
# reverse; prints per window the system,
# requests a second and its CPU µs per request (utime + stime of all its
# processes).
set -e
D=$(cd "$(dirname "$0")" && pwd)
N=$1; C=$2; shift 2; SPECS=("$@" nginx)
W=$(mktemp -d); chmod 755 $W
trap 'kill $(cat $W/nginx.pid 2>/dev/null) 2>/dev/null || true; kill $(cat $W/px.pid 2>/dev/null) 2>/dev/null || true; rm -rf $W' EXIT
mkdir -p $W/root $W/px $W/cache; chmod 777 $W/cache; head -c 1024 /dev/zero | tr '\0' 'x' > $W/root/obj
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
cat > $W/px.conf <<T
worker_processes $(nproc);
pid $W/px.pid;
error_log $W/px/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    proxy_cache_path $W/cache levels=1:2 keys_zone=c:10m max_size=64m;
    upstream o { server 127.0.0.1:18191; keepalive 32; }
    server { listen 127.0.0.1:18193;
        location / { proxy_pass http://o; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_cache c; } }
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
ticks() { local t=0; for p in "$@"; do t=$((t + $(awk '{print $14+$15}' /proc/$p/stat))); done; echo $t; }
HZ=$(getconf CLK_TCK)
window() { # name port pids...
  local name=$1 port=$2; shift 2
  wrk -t1 -c$C -d1s -H "Connection: close" http://127.0.0.1:$port/obj > /dev/null
  local t0; t0=$(ticks "$@")
  local out; out=$(wrk -t1 -c$C -d5s -H "Connection: close" http://127.0.0.1:$port/obj)
  local t1; t1=$(ticks "$@")
  local reqs rps; reqs=$(echo "$out" | awk '/requests in/{print $1}'); rps=$(echo "$out" | awk '/Requests\/sec/{print $2}')
  echo "$name $rps $(awk -v t=$((t1-t0)) -v hz=$HZ -v r=$reqs 'BEGIN{printf "%.1f", t/hz/r*1e6}') $(echo "$out" | awk '/Non-2xx|Socket errors/' | tr '\n' ' ')"
}
for i in $(seq 1 $N); do
  order=("${SPECS[@]}"); for ((k=${#SPECS[@]}-1; k>=0; k--)); do order+=("${SPECS[k]}"); done
  for spec in "${order[@]}"; do
    if [ "$spec" != nginx ]; then
      bin=${spec#*=}
      INBAND_LOG=warn $bin proxy --config $W/p.toml > $W/proxy.log 2>&1 &
      P=$!; sleep 1
      window "inband-${spec%%=*}" 18190 $P
      kill $P; wait $P 2>/dev/null || true
    else
      nginx -c $W/px.conf -p $W/px -g "daemon on;"; sleep 1
      window nginx 18193 $(pgrep -P $(cat $W/px.pid)) $(cat $W/px.pid)
      kill $(cat $W/px.pid); sleep 0.5
    fi
  done
done
