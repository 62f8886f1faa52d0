fn main() {
    inband_bpf_build::skeletons(&["mesh", "mesh_head_probe"]);
}
