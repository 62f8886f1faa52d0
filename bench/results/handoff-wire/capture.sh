#!/bin/bash
# wait for testbed hprobe, then capture on c1 (and s1) eth0
for i in $(seq 1 600); do [ -f /run/inband/testbed/hprobe.json ] && break; sleep 0.5; done
sleep 1
C1=$(python3 -c "import json;s=json.load(open('/run/inband/testbed/hprobe.json'));print([n['netns'] for n in s['nodes'] if n['node']=='c1'][0])")
S1=$(python3 -c "import json;s=json.load(open('/run/inband/testbed/hprobe.json'));print([n['netns'] for n in s['nodes'] if n['node']=='s1'][0])")
echo "c1=$C1 s1=$S1"
ip netns exec $C1 timeout 600 tcpdump -i any -s 200 -w /tmp/hp/c1.pcap -n 'tcp' 2>/tmp/hp/td1.log &
ip netns exec $S1 timeout 600 tcpdump -i any -s 200 -w /tmp/hp/s1.pcap -n 'tcp' 2>/tmp/hp/td2.log &
wait
