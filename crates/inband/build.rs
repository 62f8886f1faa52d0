fn main() {
    // The upgrade test's "next release": the balancer with a field inserted
    // into its flow struct (bpf/include/inband/lb/types.h), so that the
    // pinned flow tables change layout under running connections.
    let obj = inband_bpf_build::object("balancer", "balancer-layout-test.bpf.o", &["INBAND_LAYOUT_TEST"]);
    println!("cargo:rustc-env=INBAND_LAYOUT_TEST_OBJECT={}", obj.display());
}
