//! Compiles the BPF programs under bpf/ and generates their libbpf-rs
//! skeletons, so the one `inband` binary carries every program it loads.

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const PROGRAMS: &[&str] = &["balancer", "agent", "bounce", "veth_peer", "loadgen"];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let bpf_dir = manifest.join("../../bpf").canonicalize().expect("bpf/ next to crates/");
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap());
    // Debian keeps asm/ under the multiarch directory, which clang does not
    // search for -target bpf.
    let multiarch = format!("-I/usr/include/{}-linux-gnu", env::consts::ARCH);
    for name in PROGRAMS {
        let src = bpf_dir.join(format!("{name}.bpf.c"));
        let skel = out.join(format!("{name}.skel.rs"));
        SkeletonBuilder::new()
            .source(&src)
            .clang_args([
                format!("-I{}", bpf_dir.join("include").display()),
                multiarch.clone(),
                // v3: atomic fetch-and-add with a result (round-robin
                // tickets), 32-bit jumps; every kernel with bpf_loop has it.
                "-mcpu=v3".to_string(),
                "-Wall".to_string(),
                "-Werror".to_string(),
            ])
            .build_and_generate(&skel)
            .unwrap_or_else(|e| panic!("building {}: {e:#}", src.display()));
    }
    println!("cargo:rerun-if-changed={}", bpf_dir.display());
}
