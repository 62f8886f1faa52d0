//! Names for code addresses of the target (the memory pass's call sites):
//! the mapping an address falls in (`/proc/PID/maps`), then the function of
//! that file whose range holds it (the ELF symbol tables, through
//! `object`; Rust names demangled).

use std::collections::HashMap;
use std::path::PathBuf;

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// An executable mapping: [start, end) holds the file's bytes from
/// `offset` on.
struct Mapping {
    start: u64,
    end: u64,
    offset: u64,
    path: PathBuf,
}

/// A file's functions by address, and its loaded segments (virtual
/// address, file offset, size) to turn a file offset into an address.
struct Symbols {
    functions: Vec<(u64, u64, String)>,
    segments: Vec<(u64, u64, u64)>,
}

#[derive(Default)]
pub struct Symbolizer {
    mappings: Vec<Mapping>,
    files: HashMap<PathBuf, Option<Symbols>>,
}

impl Symbolizer {
    /// Reads the process's mappings again (libraries come and go), and the
    /// symbols of files it newly maps, while its root can be reached; keeps
    /// both once the process has exited, for the last snapshot.
    pub fn refresh(&mut self, pid: u32) {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { return };
        let mappings: Vec<Mapping> = maps
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let (range, perms, offset, path) = (f.first()?, f.get(1)?, f.get(2)?, f.get(5)?);
                if !perms.contains('x') || !path.starts_with('/') {
                    return None;
                }
                let (start, end) = range.split_once('-')?;
                Some(Mapping {
                    start: u64::from_str_radix(start, 16).ok()?,
                    end: u64::from_str_radix(end, 16).ok()?,
                    offset: u64::from_str_radix(offset, 16).ok()?,
                    // Through the process's root, as the memory pass's
                    // allocator file: a container's own libraries.
                    path: PathBuf::from(format!("/proc/{pid}/root{path}")),
                })
            })
            .collect();
        for m in &mappings {
            if !self.files.contains_key(&m.path) {
                self.files.insert(m.path.clone(), load(&m.path));
            }
        }
        if !mappings.is_empty() {
            self.mappings = mappings;
        }
    }

    /// Whether `address` lies in an executable mapping of the process.
    pub fn is_code(&self, address: u64) -> bool {
        self.mappings.iter().any(|m| address >= m.start && address < m.end)
    }

    /// `function+0xoffset`, or `file+0xoffset` in a file without a symbol
    /// there, or the bare address outside every known mapping.
    pub fn name(&mut self, address: u64) -> String {
        let Some(m) = self.mappings.iter().find(|m| address >= m.start && address < m.end) else {
            return format!("{address:#x}");
        };
        let file_offset = address - m.start + m.offset;
        let path = m.path.clone();
        let file_name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
        let symbols = self.files.entry(path.clone()).or_insert_with(|| load(&path));
        let Some(symbols) = symbols else { return format!("{file_name}+{file_offset:#x}") };
        let Some(vaddr) = symbols
            .segments
            .iter()
            .find(|(_, off, size)| file_offset >= *off && file_offset < off + size)
            .map(|(vaddr, off, _)| vaddr + (file_offset - off))
        else {
            return format!("{file_name}+{file_offset:#x}");
        };
        let i = symbols.functions.partition_point(|(start, _, _)| *start <= vaddr);
        match i.checked_sub(1).map(|i| &symbols.functions[i]) {
            Some((start, size, name)) if vaddr < start + (*size).max(1) => format!("{name}+{:#x}", vaddr - start),
            _ => format!("{file_name}+{file_offset:#x}"),
        }
    }
}

fn load(path: &PathBuf) -> Option<Symbols> {
    let data = std::fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let mut functions: Vec<(u64, u64, String)> = file
        .symbols()
        .chain(file.dynamic_symbols())
        .filter(|s| s.kind() == SymbolKind::Text && s.is_definition())
        .filter_map(|s| Some((s.address(), s.size(), format!("{:#}", rustc_demangle::demangle(s.name().ok()?)))))
        .collect();
    functions.sort_unstable_by_key(|(address, _, _)| *address);
    functions.dedup_by_key(|(address, _, _)| *address);
    let segments = file
        .segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            (s.address(), offset, size)
        })
        .collect();
    Some(Symbols { functions, segments })
}
