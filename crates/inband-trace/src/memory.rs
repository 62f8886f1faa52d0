//! The memory pass (`--memory`, docs/trace.md "Memory pass"): which
//! allocator functions get a uprobe, and in which file.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::bpf::shared::{
    INBAND_TRACE_ALIGNED_ALLOC, INBAND_TRACE_ALLOC_FNS, INBAND_TRACE_CALLOC, INBAND_TRACE_FREE, INBAND_TRACE_MALLOC,
    INBAND_TRACE_POSIX_MEMALIGN, INBAND_TRACE_REALLOC,
};

/// By the program's function number; the C allocator's names. The first
/// four every C library has; the aligned ones are traced where they exist.
pub const FUNCTIONS: [(u32, &str, bool); INBAND_TRACE_ALLOC_FNS as usize] = [
    (INBAND_TRACE_MALLOC, "malloc", true),
    (INBAND_TRACE_CALLOC, "calloc", true),
    (INBAND_TRACE_REALLOC, "realloc", true),
    (INBAND_TRACE_FREE, "free", true),
    (INBAND_TRACE_ALIGNED_ALLOC, "aligned_alloc", false),
    (INBAND_TRACE_POSIX_MEMALIGN, "posix_memalign", false),
];

/// mimalloc linked into the executable (as `inband` has it), by the entry
/// points Rust's `GlobalAlloc` for it calls, each under the role of the C
/// function whose size argument sits where its own does: an allocation
/// zeroed or not counts as `malloc` (the size is the first argument of
/// both), a reallocation as `realloc` (the second). A reallocation that
/// moves its block calls `mi_free` itself, so it also counts a `free`.
pub const MIMALLOC: [(u32, &str); 4] = [
    (INBAND_TRACE_MALLOC, "mi_malloc_aligned"),
    (INBAND_TRACE_MALLOC, "mi_zalloc_aligned"),
    (INBAND_TRACE_REALLOC, "mi_realloc_aligned"),
    (INBAND_TRACE_FREE, "mi_free"),
];

/// Where the memory pass puts its uprobes: per file, each function's role
/// and offsets. The C library's functions (or a static executable's) are
/// required; an executable with mimalloc in it has its entry points too,
/// since what goes through them never reaches the C library.
pub fn allocator_probes(pid: u32) -> Result<Vec<(PathBuf, Vec<(u32, Vec<u64>)>)>> {
    let file = allocator_file(pid)?;
    let mut found = Vec::new();
    for (function, name, required) in FUNCTIONS {
        match crate::symbols::function_offsets(&file, name) {
            Ok(offsets) => found.push((function, offsets)),
            Err(e) if required => return Err(e.context(format!("memory pass on pid {pid}"))),
            Err(_) => {}
        }
    }
    let mut probes = vec![(file, found)];
    let exe = PathBuf::from(format!("/proc/{pid}/exe"));
    if crate::symbols::function_offsets(&exe, MIMALLOC[0].1).is_ok() {
        let linked = MIMALLOC
            .iter()
            .map(|(function, name)| Ok((*function, crate::symbols::function_offsets(&exe, name).with_context(|| format!("memory pass on pid {pid}: mimalloc without {name}"))?)))
            .collect::<Result<Vec<_>>>()?;
        probes.push((exe, linked));
    }
    Ok(probes)
}

pub fn name(function: u32) -> &'static str {
    FUNCTIONS.iter().find(|(f, _, _)| *f == function).map_or("?", |(_, n, _)| n)
}

/// The file whose allocator the process uses: the C library it maps
/// (reached through the process's root, so a container's own libc is the
/// one), or, for a static executable, the executable itself.
fn allocator_file(pid: u32) -> Result<PathBuf> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).with_context(|| format!("reading /proc/{pid}/maps"))?;
    let libc = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|path| {
        let file = path.rsplit('/').next().unwrap_or("");
        file.starts_with("libc.so") || file.starts_with("libc-")
    });
    match libc {
        Some(path) => Ok(PathBuf::from(format!("/proc/{pid}/root{path}"))),
        None if maps.lines().any(|l| l.contains(".so")) => {
            bail!("process {pid} maps shared libraries but no C library: its allocator is not one the memory pass knows")
        }
        None => Ok(PathBuf::from(format!("/proc/{pid}/exe"))),
    }
}
