//! Where a phase marker's function starts in the target's executable file:
//! the uprobe is placed by file offset, found from the ELF symbol tables
//! (`object`) so that a missing name is reported by name.

use std::path::Path;

use anyhow::{bail, Context, Result};
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// A generic Rust function has one copy per type it is used with, each its
/// own uprobe; past this many a marker is too broad to be a phase.
const MAX_COPIES: usize = 64;

/// The file offsets of function `name` in `binary`, from the static symbol
/// table and the dynamic one (a stripped binary keeps only the latter).
/// `name` is the symbol as the table has it, or, for Rust, the path the
/// source uses (`crate::module::function`, `<Type as Trait>::method`):
/// every copy of a generic function is one offset.
pub fn function_offsets(binary: &Path, name: &str) -> Result<Vec<u64>> {
    let data = std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let file = object::File::parse(&*data).with_context(|| format!("{} is not an ELF file", binary.display()))?;
    let mut addresses: Vec<u64> = file
        .symbols()
        .chain(file.dynamic_symbols())
        .filter(|s| s.kind() == SymbolKind::Text && s.is_definition())
        .filter(|s| s.name().is_ok_and(|raw| raw == name || format!("{:#}", rustc_demangle::demangle(raw)) == name))
        .map(|s| s.address())
        .collect();
    addresses.sort_unstable();
    addresses.dedup();
    if addresses.is_empty() {
        bail!("symbol {name} is not a function defined in {}", binary.display());
    }
    if addresses.len() > MAX_COPIES {
        bail!("symbol {name} names {} functions in {}; a marker takes at most {MAX_COPIES}", addresses.len(), binary.display());
    }
    addresses.into_iter().map(|a| file_offset(&file, a).with_context(|| format!("symbol {name} in {}", binary.display()))).collect()
}

fn file_offset(file: &object::File, address: u64) -> Result<u64> {
    for segment in file.segments() {
        let (offset, size) = segment.file_range();
        if address >= segment.address() && address - segment.address() < size {
            return Ok(offset + (address - segment.address()));
        }
    }
    bail!("{address:#x} lies in no loaded segment")
}
