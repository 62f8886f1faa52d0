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

pub fn name(function: u32) -> &'static str {
    FUNCTIONS.iter().find(|(f, _, _)| *f == function).map_or("?", |(_, n, _)| n)
}

/// The file whose allocator the process uses: the C library it maps
/// (reached through the process's root, so a container's own libc is the
/// one), or, for a static executable, the executable itself.
pub fn allocator_file(pid: u32) -> Result<PathBuf> {
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
