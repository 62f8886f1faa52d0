fn main() {
    inband_bpf_build::skeletons(&["bounce", "veth_peer", "loadgen"]);
}
