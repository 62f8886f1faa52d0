//! Where a phase marker's function starts in the target's executable file:
//! the uprobe is placed by file offset, found from the ELF symbol tables
//! (`object`) so that a missing or ambiguous name is reported by name.

use std::path::Path;

use anyhow::{bail, Context, Result};
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// The file offset of function `name` in `binary`, looked up in the static
/// symbol table, then the dynamic one (a stripped binary keeps only the
/// latter).
pub fn function_offset(binary: &Path, name: &str) -> Result<u64> {
    let data = std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let file = object::File::parse(&*data).with_context(|| format!("{} is not an ELF file", binary.display()))?;
    let mut addresses: Vec<u64> = file
        .symbols()
        .chain(file.dynamic_symbols())
        .filter(|s| s.kind() == SymbolKind::Text && s.is_definition() && s.name() == Ok(name))
        .map(|s| s.address())
        .collect();
    addresses.sort_unstable();
    addresses.dedup();
    let address = match addresses[..] {
        [a] => a,
        [] => bail!("symbol {name} is not a function defined in {}", binary.display()),
        _ => bail!("symbol {name} names {} functions in {}; a marker needs one", addresses.len(), binary.display()),
    };
    for segment in file.segments() {
        let (offset, size) = segment.file_range();
        if address >= segment.address() && address - segment.address() < size {
            return Ok(offset + (address - segment.address()));
        }
    }
    bail!("symbol {name} at {address:#x} lies in no loaded segment of {}", binary.display())
}
