//! Compiles the BPF programs under bpf/ and generates their libbpf-rs
//! skeletons, so the one `inband` binary carries every program it loads;
//! and generates the Rust types of the maps and the wire format from the C
//! headers under bpf/include/inband/ (bindgen), so those headers are the
//! only definition of either.

use std::env;
use std::path::{Path, PathBuf};

use libbpf_cargo::SkeletonBuilder;

const PROGRAMS: &[&str] = &["balancer", "agent", "bounce", "veth_peer", "loadgen", "shadow", "mesh", "mesh_head_probe"];
/// The headers whose types and constants the control plane shares.
const SHARED_HEADERS: &[&str] = &["addr.h", "quic.h", "wire.h", "auth.h", "lb/consts.h", "lb/types.h", "agent/consts.h", "agent/types.h", "shadow/types.h", "mesh/consts.h", "mesh/types.h"];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let bpf_dir = manifest.join("../../bpf").canonicalize().expect("bpf/ next to crates/");
    let include = bpf_dir.join("include");
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
                format!("-I{}", include.display()),
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
    shared_types(&include, &multiarch, &out.join("shared.rs"));
    // Relative to the package root, not the absolute path: a build directory
    // kept outside the clone (scripts/setup.sh) then watches the bpf/ of
    // whichever clone builds, not the one that built first.
    println!("cargo:rerun-if-changed=../../bpf");
}

fn shared_types(include: &Path, multiarch: &str, out: &Path) {
    let wrapper: String = SHARED_HEADERS.iter().map(|h| format!("#include \"inband/{h}\"\n")).collect();
    bindgen::Builder::default()
        .header_contents("inband_shared.h", &wrapper)
        .clang_args([format!("-I{}", include.display()), multiarch.to_string()])
        .allowlist_type("inband_.*")
        .allowlist_var("INBAND_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_eq(true)
        .derive_hash(true)
        .layout_tests(true)
        .generate()
        .expect("generating Rust types from bpf/include/inband")
        .write_to_file(out)
        .expect("writing shared.rs");
}
