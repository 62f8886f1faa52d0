fn main() {
    inband_bpf_build::skeletons(&["shadow", "shadow_dt4"]);
}
