fn main() {
    inband_bpf_build::skeletons(&["shadow"]);
}
