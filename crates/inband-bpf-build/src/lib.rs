//! What every crate's build.rs shares: compiling its BPF programs under
//! bpf/ into libbpf-rs skeletons (so each crate carries exactly the programs
//! it loads, and a change to one program rebuilds only the crates above it),
//! and generating the Rust types of the maps and the wire format from the C
//! headers under bpf/include/inband/ (bindgen, for inband-core), so those
//! headers are the only definition of either.

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

/// bpf/ and the include flags every compile of it needs.
struct Sources {
    bpf: PathBuf,
    include: PathBuf,
    // Debian keeps asm/ under the multiarch directory, which clang does not
    // search for -target bpf.
    multiarch: String,
}

fn sources() -> Sources {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let bpf = manifest.join("../../bpf").canonicalize().expect("bpf/ next to crates/");
    // Relative to the package root, not the absolute path: a build directory
    // kept outside the clone (scripts/setup.sh) then watches the bpf/ of
    // whichever clone builds, not the one that built first.
    println!("cargo:rerun-if-changed=../../bpf");
    Sources { include: bpf.join("include"), bpf, multiarch: format!("-I/usr/include/{}-linux-gnu", env::consts::ARCH) }
}

/// Compiles `bpf/<name>.bpf.c` for each of `programs` and writes
/// `<name>.skel.rs` and the object, `<name>.bpf.o`, into OUT_DIR.
pub fn skeletons(programs: &[&str]) {
    let s = sources();
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap());
    for name in programs {
        let src = s.bpf.join(format!("{name}.bpf.c"));
        SkeletonBuilder::new()
            .source(&src)
            .obj(out.join(format!("{name}.bpf.o")))
            .clang_args([
                format!("-I{}", s.include.display()),
                s.multiarch.clone(),
                // v3: atomic fetch-and-add with a result (round-robin
                // tickets), 32-bit jumps; every kernel with bpf_loop has it.
                "-mcpu=v3".to_string(),
                "-Wall".to_string(),
                "-Werror".to_string(),
            ])
            .build_and_generate(out.join(format!("{name}.skel.rs")))
            .unwrap_or_else(|e| panic!("building {}: {e:#}", src.display()));
    }
}

/// Compiles `bpf/<name>.bpf.c` with `defines` (`-D` flags) into
/// OUT_DIR/`out`, an object only (no skeleton), and returns its path.
pub fn object(name: &str, out: &str, defines: &[&str]) -> PathBuf {
    let s = sources();
    let path = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join(out);
    let src = s.bpf.join(format!("{name}.bpf.c"));
    let mut args = vec![format!("-I{}", s.include.display()), s.multiarch.clone(), "-mcpu=v3".into(), "-Wall".into(), "-Werror".into()];
    args.extend(defines.iter().map(|d| format!("-D{d}")));
    SkeletonBuilder::new()
        .source(&src)
        .obj(&path)
        .clang_args(args)
        .build()
        .unwrap_or_else(|e| panic!("building {}: {e:#}", src.display()));
    path
}

/// Writes `shared.rs` into OUT_DIR: the `inband_*` types and `INBAND_*`
/// constants of `headers` (paths under bpf/include/inband/).
pub fn shared_types(headers: &[&str]) {
    let s = sources();
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("shared.rs");
    let wrapper: String = headers.iter().map(|h| format!("#include \"inband/{h}\"\n")).collect();
    bindgen::Builder::default()
        .header_contents("inband_shared.h", &wrapper)
        .clang_args([format!("-I{}", s.include.display()), s.multiarch])
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
