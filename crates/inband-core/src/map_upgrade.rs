//! Carrying a running data path's pinned maps over to a build whose map
//! layouts differ (a field added, moved or removed, a table resized, flags
//! changed), without stopping the data path.
//!
//! The old program keeps running on the old maps until the new one is
//! attached. The new maps are created beside them (pinned under
//! `staged_upgrade/` in the same directory) and filled from the old ones; the
//! caller attaches the new program; then what the old program changed
//! while the copy ran is merged in, and the new maps are renamed over the
//! old pins (one atomic rename each). A process that dies half-way leaves
//! `staged_upgrade/`, which [`recover`] settles by asking which maps the attached
//! program uses.
//!
//! Fields are matched by name through BTF: the kernel keeps every pinned
//! map's key and value types, and the new object carries its own, so no
//! version number has to be kept in step with the C headers, and a field
//! that moved is still found. A field new to the layout starts at zero (the
//! C side's rule: a new field's zero means what the data path did before
//! it existed; padding holds nothing, so a new field may take its bytes).
//! A field that changed its type, a key field that is gone while entries
//! use it (two entries could become one), and a table shrunk below what it
//! holds cannot be carried: [`Upgrade::stage`] and [`Upgrade::copy`]
//! refuse them before anything the running data path uses is touched.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::btf::types::{Array, Composite, Enum, Enum64, Int, IntEncoding, MemberAttr};
use libbpf_rs::btf::{BtfKind, BtfType, TypeId};
use libbpf_rs::query::{ProgInfoIter, ProgInfoQueryOptions};
use libbpf_rs::libbpf_sys::bpf_map_info;
use libbpf_rs::{AsRawLibbpf, Btf, HasSize, MapCore, MapFlags, MapHandle, MapType, Object, OpenMapMut, OpenObject};

use crate::bpfmap::{remove_pin_dir, PinDir};
use xxhash_rust::xxh3::xxh3_64;

/// Where the new maps wait, inside the pin directory, until they take over.
// bpffs refuses dots in names (they are the kernel's), so no hidden name.
const STAGING: &str = "staged_upgrade";
/// Entries a batch syscall moves.
const BATCH: u32 = 4096;
/// How long the old program may still run after the new one is attached:
/// an XDP or tc program runs inside one softirq pass, which the kernel
/// bounds at 2 ms; the rest is margin for a loaded host.
const GRACE: Duration = Duration::from_millis(50);

/// One field of a key or value. Structs are walked into their members;
/// anything else (an integer, an array, a union, an enum) is one leaf,
/// carried whole when its name and shape match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leaf {
    pub path: String,
    pub offset: usize,
    pub size: usize,
    /// The type spelled out (`u32`, `[16]u8`, `union{a@0:u32,...}`): two
    /// leaves of one name are the same field only if these agree.
    pub shape: String,
}

impl Leaf {
    /// Padding holds nothing (the data path writes it zero), so a new field
    /// may take its bytes: it is neither carried nor compared.
    fn is_padding(&self) -> bool {
        self.path.rsplit('.').next().is_some_and(|name| name.starts_with("pad"))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub size: usize,
    pub leaves: Vec<Leaf>,
}

impl Layout {
    /// The layout of BTF type `id`.
    pub fn of(btf: &Btf, id: u32) -> Result<Layout> {
        let mut leaves = Vec::new();
        let size = walk(btf, TypeId::from(id), String::new(), 0, &mut leaves)?;
        Ok(Layout { size, leaves })
    }

    /// A value of no struct type (a counter, a port): one leaf named "".
    pub fn scalar(size: usize) -> Layout {
        Layout { size, leaves: vec![Leaf { path: String::new(), offset: 0, size, shape: format!("bytes{size}") }] }
    }
}

fn walk(btf: &Btf, id: TypeId, path: String, base: usize, out: &mut Vec<Leaf>) -> Result<usize> {
    let t = btf.type_by_id::<BtfType>(id).ok_or_else(|| anyhow!("BTF type {id:?} is missing"))?.skip_mods_and_typedefs();
    if t.kind() == BtfKind::Struct {
        let c = Composite::try_from(t).map_err(|_| anyhow!("BTF type {id:?} is not a struct"))?;
        for m in c.iter() {
            let offset = match m.attr {
                MemberAttr::Normal { offset } if offset % 8 == 0 => offset as usize / 8,
                _ => bail!("{path}: bit fields cannot be carried across a layout change"),
            };
            let name = m.name.map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            // An anonymous member's fields are reached in C as its parent's.
            let sub = match (path.is_empty(), name.is_empty()) {
                (_, true) => path.clone(),
                (true, false) => name,
                (false, false) => format!("{path}.{name}"),
            };
            walk(btf, m.ty, sub, base + offset, out)?;
        }
        return Ok(c.size());
    }
    let (size, shape) = shape(btf, t)?;
    out.push(Leaf { path, offset: base, size, shape });
    Ok(size)
}

fn shape(btf: &Btf, t: BtfType) -> Result<(usize, String)> {
    let t = t.skip_mods_and_typedefs();
    Ok(match t.kind() {
        BtfKind::Int => {
            let i = Int::try_from(t).map_err(|_| anyhow!("not an int"))?;
            let sign = if matches!(i.encoding, IntEncoding::Signed) { "i" } else { "u" };
            ((i.bits as usize).div_ceil(8), format!("{sign}{}", i.bits))
        }
        BtfKind::Enum => {
            let e = Enum::try_from(t).map_err(|_| anyhow!("not an enum"))?;
            (e.size(), format!("enum{}", e.size()))
        }
        BtfKind::Enum64 => {
            let e = Enum64::try_from(t).map_err(|_| anyhow!("not an enum"))?;
            (e.size(), format!("enum{}", e.size()))
        }
        BtfKind::Array => {
            let a = Array::try_from(t).map_err(|_| anyhow!("not an array"))?;
            let (n, s) = shape(btf, a.contained_type())?;
            (n * a.capacity(), format!("[{}]{s}", a.capacity()))
        }
        BtfKind::Struct | BtfKind::Union => {
            let c = Composite::try_from(t).map_err(|_| anyhow!("not a composite"))?;
            let mut parts = Vec::new();
            for m in c.iter() {
                let member = btf.type_by_id::<BtfType>(m.ty).ok_or_else(|| anyhow!("BTF type {:?} is missing", m.ty))?;
                let (_, s) = shape(btf, member)?;
                let name = m.name.map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let offset = match m.attr {
                    MemberAttr::Normal { offset } => offset,
                    MemberAttr::BitField { offset, .. } => offset,
                };
                parts.push(format!("{name}@{offset}:{s}"));
            }
            let kind = if t.kind() == BtfKind::Union { "union" } else { "struct" };
            (c.size(), format!("{kind}{{{}}}", parts.join(",")))
        }
        k => bail!("a field of kind {k:?} cannot be carried across a layout change"),
    })
}

/// How to turn a value of one layout into the other: byte ranges to copy,
/// everything else zero.
#[derive(Clone, Debug)]
pub struct Conversion {
    size: usize,
    copies: Vec<(usize, usize, usize)>,
    /// Ranges of the new value that hold counters (integers of a per-CPU
    /// map) and came from the old value: merged by adding what the old
    /// program counted after the first copy.
    counters: Vec<(usize, usize, usize)>,
    /// Fields of the old layout the new one lacks (padding aside): (path,
    /// offset, size) in the old value.
    dropped: Vec<(String, usize, usize)>,
}

impl Conversion {
    /// Refuses a field whose type changed; a field only the old layout has
    /// is dropped, one only the new has starts at zero.
    pub fn new(map: &str, from: &Layout, to: &Layout, per_cpu: bool) -> Result<Conversion> {
        let mut copies = Vec::new();
        let mut counters = Vec::new();
        for l in to.leaves.iter().filter(|l| !l.is_padding()) {
            let Some(o) = from.leaves.iter().find(|o| o.path == l.path) else { continue };
            if o.shape != l.shape {
                bail!("map {map}: field `{}` changed from {} to {}, which no upgrade can carry", l.path, o.shape, l.shape);
            }
            copies.push((o.offset, l.offset, l.size));
            if per_cpu && matches!(l.size, 1 | 2 | 4 | 8) && (l.shape.starts_with('u') || l.shape.starts_with('i')) {
                counters.push((o.offset, l.offset, l.size));
            }
        }
        let dropped = from
            .leaves
            .iter()
            .filter(|o| !o.is_padding() && !to.leaves.iter().any(|l| l.path == o.path))
            .map(|o| (o.path.clone(), o.offset, o.size))
            .collect();
        Ok(Conversion { size: to.size, copies, counters, dropped })
    }

    /// The first field this conversion would lose a value of in `old`.
    pub fn loses(&self, old: &[u8]) -> Option<&str> {
        self.dropped.iter().find(|(_, off, n)| old[*off..off + n].iter().any(|&b| b != 0)).map(|(path, _, _)| path.as_str())
    }

    /// `apply` to each CPU's value of `old` (`from` bytes each), back to back.
    fn apply_all(&self, old: &[u8], from: usize) -> Vec<u8> {
        old.chunks(from.max(1)).flat_map(|v| self.apply(v)).collect()
    }

    /// `merge` for each CPU's values.
    fn merge_all(&self, first: &[u8], last: &[u8], now: &[u8], from: usize) -> Vec<u8> {
        let from = from.max(1);
        first.chunks(from).zip(last.chunks(from)).zip(now.chunks(self.size.max(1))).flat_map(|((f, l), n)| self.merge(f, l, n)).collect()
    }

    pub fn apply(&self, old: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; self.size];
        for &(from, to, n) in &self.copies {
            out[to..to + n].copy_from_slice(&old[from..from + n]);
        }
        out
    }

    /// The value the new map should hold after the switch, from what the
    /// old map held at the first copy (`first`), what it held when the old
    /// program stopped (`last`) and what the new map holds now (`now`).
    /// A counter gets the old program's late increments added; any other
    /// field takes the old program's last write unless the new program has
    /// written it since (then the newer write stands).
    pub fn merge(&self, first: &[u8], last: &[u8], now: &[u8]) -> Vec<u8> {
        let mut out = now.to_vec();
        let copied = self.apply(first);
        for &(from, to, n) in &self.copies {
            if let Some(&(_, _, size)) = self.counters.iter().find(|c| c.1 == to) {
                let get = |b: &[u8]| b[..size].iter().rev().fold(0u64, |a, &x| (a << 8) | x as u64);
                let delta = get(&last[from..]).wrapping_sub(get(&first[from..]));
                let sum = get(&now[to..]).wrapping_add(delta);
                out[to..to + size].copy_from_slice(&sum.to_le_bytes()[..size]);
            } else if now[to..to + n] == copied[to..to + n] {
                out[to..to + n].copy_from_slice(&last[from..from + n]);
            }
        }
        out
    }
}

/// A map's entries, flat: keys and values (a per-CPU map's: one value per
/// CPU, back to back) in two buffers, found by key through an index of
/// xxh3 hashes. Millions of entries, each in allocations of its own, took
/// longer to build, compare and free than the system calls that read them,
/// and an upgrade's merge after the switch is as long as a pass over them.
#[derive(Default)]
struct Entries {
    key_size: usize,
    /// Bytes of one entry's value(s).
    value_size: usize,
    keys: Vec<u8>,
    values: Vec<u8>,
    /// Hash of a key -> its entry; keys whose hash another key has already
    /// are in `collided`.
    index: HashMap<u64, u32>,
    collided: HashMap<Vec<u8>, u32>,
}

impl Entries {
    fn new(key_size: usize, value_size: usize) -> Entries {
        Entries { key_size, value_size, ..Default::default() }
    }

    fn push(&mut self, key: &[u8], value: &[u8]) {
        let i = self.len() as u32;
        self.keys.extend_from_slice(key);
        self.values.extend_from_slice(value);
        match self.index.entry(xxh3_64(key)) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(i);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.collided.insert(key.to_vec(), i);
            }
        }
    }

    fn len(&self) -> usize {
        self.keys.len() / self.key_size.max(1)
    }

    fn key(&self, i: usize) -> &[u8] {
        &self.keys[i * self.key_size..(i + 1) * self.key_size]
    }

    fn value(&self, i: usize) -> &[u8] {
        &self.values[i * self.value_size..(i + 1) * self.value_size]
    }

    fn get(&self, key: &[u8]) -> Option<&[u8]> {
        let i = match self.index.get(&xxh3_64(key)) {
            Some(&i) if self.key(i as usize) == key => i,
            _ => *self.collided.get(key)?,
        };
        Some(self.value(i as usize))
    }

    fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        (0..self.len()).map(|i| (self.key(i), self.value(i)))
    }
}

/// One value per CPU of a per-CPU map (libbpf's layout), one of another.
fn per_cpu_values(map: &MapHandle) -> Result<usize> {
    Ok(if map.map_type().is_percpu() { libbpf_rs::num_possible_cpus()? } else { 1 })
}

fn read_all(map: &MapHandle) -> Result<Entries> {
    let ty = map.map_type();
    let (ks, vs) = (map.key_size() as usize, map.value_size() as usize);
    let mut out = Entries::new(ks, vs * per_cpu_values(map)?);
    if ty == MapType::RingBuf {
        return Ok(out);
    }
    if ty.is_percpu() {
        let keys: Vec<Vec<u8>> = if matches!(ty, MapType::PercpuArray) {
            (0..map.max_entries()).map(|k| k.to_ne_bytes().to_vec()).collect()
        } else {
            map.keys().collect()
        };
        for k in keys {
            if let Some(v) = map.lookup_percpu(&k, MapFlags::ANY)? {
                out.push(&k, &v.concat());
            }
        }
        return Ok(out);
    }
    batch_read(map, &mut |k, v| out.push(k, v))?;
    Ok(out)
}

/// Every entry of a shared (not per-CPU) map, by BPF_MAP_LOOKUP_BATCH.
/// By hand rather than libbpf-rs's `lookup_batch`: its iterator takes a
/// batch shorter than asked for as the last one, and a hash map's batch
/// ends at a bucket boundary, so it stopped after the first few thousand
/// entries of a large table (bench.upgrade carried 4,095 of a million
/// flows through it); and it ends silently on an error.
fn batch_read(map: &MapHandle, each: &mut dyn FnMut(&[u8], &[u8])) -> Result<()> {
    use std::os::fd::{AsFd, AsRawFd};
    let (ks, vs) = (map.key_size() as usize, map.value_size() as usize);
    // Hash maps' batch keys are at least 4 bytes (the kernel's bucket cursor).
    let cursor = ks.max(4);
    let mut want = BATCH as usize;
    let mut keys = vec![0u8; want * ks];
    let mut values = vec![0u8; want * vs];
    let (mut prev, mut next) = (vec![0u8; cursor], vec![0u8; cursor]);
    let mut first = true;
    let opts = libbpf_rs::libbpf_sys::bpf_map_batch_opts {
        sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_batch_opts>() as _,
        ..Default::default()
    };
    loop {
        let mut count = want as u32;
        // SAFETY: the buffers hold `want` keys and values of the map's
        // sizes and a cursor of `cursor` bytes; the kernel writes at most
        // `count` of each.
        let rc = unsafe {
            libbpf_rs::libbpf_sys::bpf_map_lookup_batch(
                map.as_fd().as_raw_fd(),
                if first { std::ptr::null_mut() } else { prev.as_mut_ptr().cast() },
                next.as_mut_ptr().cast(),
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                &mut count,
                &opts,
            )
        };
        let err = if rc < 0 { std::io::Error::last_os_error().raw_os_error().unwrap_or(0) } else { 0 };
        match err {
            0 | libc::ENOENT => {}
            libc::EINTR => continue,
            // One bucket holds more than the batch: make room and ask again.
            libc::ENOSPC if count == 0 => {
                want *= 2;
                keys.resize(want * ks, 0);
                values.resize(want * vs, 0);
                continue;
            }
            e => bail!("reading map {} in batches: {}", map.name().to_string_lossy(), std::io::Error::from_raw_os_error(e)),
        }
        for i in 0..count as usize {
            each(&keys[i * ks..(i + 1) * ks], &values[i * vs..(i + 1) * vs]);
        }
        if err == libc::ENOENT {
            return Ok(());
        }
        std::mem::swap(&mut prev, &mut next);
        first = false;
    }
}

fn write(map: &MapHandle, entries: &Entries, flags: MapFlags) -> Result<()> {
    if map.map_type().is_percpu() {
        let vs = map.value_size() as usize;
        for (k, v) in entries.iter() {
            map.update_percpu(k, &v.chunks(vs).map(<[u8]>::to_vec).collect::<Vec<_>>(), flags)?;
        }
        return Ok(());
    }
    let n = entries.len();
    let per = BATCH as usize;
    for start in (0..n).step_by(per) {
        let end = n.min(start + per);
        let keys = &entries.keys[start * entries.key_size..end * entries.key_size];
        let values = &entries.values[start * entries.value_size..end * entries.value_size];
        map.update_batch(keys, values, (end - start) as u32, flags, MapFlags::ANY)?;
    }
    Ok(())
}

/// How one map's keys and values convert.
#[derive(Clone)]
struct Plan {
    key: Conversion,
    value: Conversion,
}

/// A map whose layout changed: its old (running) and new (staged) maps.
/// Entries are kept in the old layout, keys included.
struct Carried {
    name: String,
    old: MapHandle,
    new: MapHandle,
    plan: Plan,
    first: Entries,
    /// The old map's value size (one CPU's value).
    from: usize,
}

/// The maps of one pin directory that change layout in an upgrade.
pub struct Upgrade {
    dir: PinDir,
    /// Names of the maps to carry, with their conversions (known before
    /// load: the old layout from the kernel, the new from the object).
    plans: Vec<(String, Plan)>,
    carried: Vec<Carried>,
}

/// The shape of a map as the kernel compares it when a pinned map is reused.
fn same_shape(info: &bpf_map_info, map: &OpenMapMut) -> bool {
    MapType::from(info.type_) == map.map_type()
        && info.key_size == map.key_size()
        && info.value_size == map.value_size()
        && info.max_entries == map.max_entries()
        && info.map_flags == map.map_flags()
}

/// The BTF a pinned map was created with: loaded from the kernel through a
/// program of the same object (the running one: its BTF is the maps').
fn running_btf(btf_id: u32) -> Option<Btf<'static>> {
    let prog = ProgInfoIter::default().find(|p| p.btf_id == btf_id)?;
    Btf::from_prog_id(prog.id).ok()
}

fn type_layout(btf: Option<&Btf>, id: u32, size: u32) -> Result<Layout> {
    match btf {
        Some(b) if id != 0 => Layout::of(b, id),
        _ => Ok(Layout::scalar(size as usize)),
    }
}

impl Upgrade {
    /// Before the new object is loaded: points each of its maps (those
    /// `pinned` says are pinned) at its pin when the pinned map has the
    /// same shape and layout (it is reused, as on every restart), or at the
    /// staging directory when it does not (a new map is made and carried
    /// over). Refuses, touching nothing, what cannot be carried.
    pub fn stage(open: &mut OpenObject, dir: &PinDir, pinned: impl Fn(&str) -> bool) -> Result<Upgrade> {
        let staging = dir.0.join(STAGING);
        if staging.exists() {
            remove_pin_dir(&staging)?;
        }
        // SAFETY: the pointer is the open object's own, valid while `open` is.
        let new_btf = Btf::from_bpf_object(unsafe { open.as_libbpf_object().as_ref() })?;
        let mut plans = Vec::new();
        let mut staged = Vec::new();
        for mut map in open.maps_mut() {
            let name = map.name().to_string_lossy().into_owned();
            if !pinned(&name) {
                continue;
            }
            let pin = dir.path(&name);
            let Ok(old) = MapHandle::from_pinned_path(&pin) else {
                // New in this build, or a first start: made and pinned at load.
                map.set_pin_path(&pin).with_context(|| format!("pin path for {name}"))?;
                continue;
            };
            let info = old.info().with_context(|| format!("reading pinned map {name}"))?.info;
            let old_type = MapType::from(info.type_);
            let raw = map.as_libbpf_object().as_ptr();
            // SAFETY: `raw` is a map of the open object, valid while it is.
            let (key_id, value_id) = unsafe { (libbpf_rs::libbpf_sys::bpf_map__btf_key_type_id(raw), libbpf_rs::libbpf_sys::bpf_map__btf_value_type_id(raw)) };
            let old_btf = if info.btf_id != 0 { running_btf(info.btf_id) } else { None };
            let layouts = |btf: Option<&Btf>, k: u32, v: u32, ks: u32, vs: u32| -> Result<(Layout, Layout)> {
                Ok((type_layout(btf, k, ks)?, type_layout(btf, v, vs)?))
            };
            let (new_key, new_value) = layouts(new_btf.as_ref(), key_id, value_id, map.key_size(), map.value_size())?;
            let old_layouts = match &old_btf {
                Some(b) => Some(layouts(Some(b), info.btf_key_type_id, info.btf_value_type_id, info.key_size, info.value_size)?),
                None => None,
            };
            let unchanged = same_shape(&info, &map) && old_layouts.as_ref().is_none_or(|(k, v)| *k == new_key && *v == new_value);
            if unchanged {
                map.set_pin_path(&pin).with_context(|| format!("pin path for {name}"))?;
                continue;
            }
            let Some((old_key, old_value)) = old_layouts else {
                bail!(
                    "map {name} is pinned with another shape, and no loaded program holds its layout (the program that made it is gone), \
                     so it cannot be carried over: remove the old state first"
                );
            };
            if old_type != map.map_type() {
                bail!("map {name} changed type ({:?} to {:?}), which no upgrade can carry", old_type, map.map_type());
            }
            // A key may gain fields (each old entry's is zero), and lose
            // one only where every entry holds zero in it (checked by
            // `copy`): otherwise two entries could become one.
            let key = Conversion::new(&name, &old_key, &new_key, false)?;
            let conversion = Conversion::new(&name, &old_value, &new_value, old_type.is_percpu())?;
            if map.max_entries() < info.max_entries {
                let held = if old_type.is_hash_map() { old.keys().count() } else { nonzero_slots(&old, map.max_entries())? };
                if held > map.max_entries() as usize {
                    bail!("map {name} holds {held} entries, more than its new size {}: size it at least that large, or let it drain first", map.max_entries());
                }
            }
            staged.push(name.clone());
            map.set_pin_path(staging.join(&name)).with_context(|| format!("pin path for {name}"))?;
            plans.push((name, Plan { key, value: conversion }));
        }
        if !staged.is_empty() {
            std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
        }
        Ok(Upgrade { dir: PinDir(dir.0.clone()), plans, carried: Vec::new() })
    }

    /// Maps this upgrade carries over (empty on a plain restart).
    pub fn maps(&self) -> Vec<&str> {
        self.plans.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// After load, before attach: fills the new maps with everything the
    /// old ones hold now.
    pub fn copy(&mut self, obj: &Object) -> Result<()> {
        for (name, plan) in std::mem::take(&mut self.plans) {
            let old = MapHandle::from_pinned_path(self.dir.path(&name)).with_context(|| format!("opening pinned map {name}"))?;
            let new_map = obj.maps().find(|m| m.name().to_string_lossy() == name.as_str()).ok_or_else(|| anyhow!("map {name} not in the new object"))?;
            let new = MapHandle::try_from(&new_map).with_context(|| format!("duplicating map {name}"))?;
            let first = read_all(&old).with_context(|| format!("reading map {name}"))?;
            if let Some(field) = first.iter().find_map(|(k, _)| plan.key.loses(k)) {
                bail!("map {name}: this build's key has no field `{field}`, and entries of the running one use it: no upgrade can carry them");
            }
            let from = old.value_size() as usize;
            let mut rows = Entries::new(new.key_size() as usize, new.value_size() as usize * per_cpu_values(&new)?);
            for (k, v) in first.iter().filter(|(k, _)| fits(&new, k)) {
                rows.push(&plan.key.apply(k), &plan.value.apply_all(v, from));
            }
            write(&new, &rows, MapFlags::ANY).with_context(|| format!("copying map {name}"))?;
            self.plans.push((name.clone(), plan.clone()));
            self.carried.push(Carried { name, old, new, plan, first, from });
        }
        Ok(())
    }

    /// Just before the switch: merges what the old program changed during
    /// [`copy`](Self::copy) (a copy of millions of entries takes seconds),
    /// so that what the new program has not seen when it starts is only
    /// the last milliseconds' changes.
    pub fn catch_up(&mut self) -> Result<()> {
        for c in &mut self.carried {
            merge(c).with_context(|| format!("merging map {}", c.name))?;
        }
        Ok(())
    }

    /// After the new program is attached: merges what the old program
    /// changed since [`catch_up`](Self::catch_up), at once and again once
    /// the old program has certainly stopped, then renames the new maps
    /// over the old pins.
    pub fn finish(mut self) -> Result<()> {
        if self.carried.is_empty() {
            return Ok(());
        }
        self.catch_up()?;
        std::thread::sleep(GRACE);
        self.catch_up()?;
        settle(&self.dir, &self.carried.iter().map(|c| c.name.clone()).collect::<Vec<_>>())
    }

    /// Leaves the running data path as it was: the staged maps go.
    pub fn abandon(self) {
        let _ = remove_pin_dir(&self.dir.0.join(STAGING));
    }
}

/// Array entries past `limit` that are not all zero: what shrinking the
/// array would lose.
fn nonzero_slots(map: &MapHandle, limit: u32) -> Result<usize> {
    let mut n = limit as usize;
    for k in limit..map.max_entries() {
        let key = k.to_ne_bytes();
        let nonzero = if map.map_type().is_percpu() {
            map.lookup_percpu(&key, MapFlags::ANY)?.unwrap_or_default().iter().any(|v| v.iter().any(|&b| b != 0))
        } else {
            map.lookup(&key, MapFlags::ANY)?.unwrap_or_default().iter().any(|&b| b != 0)
        };
        n += nonzero as usize;
    }
    Ok(n)
}

/// An array index beyond the new size is dropped (checked to be empty by
/// `stage`).
fn fits(map: &MapHandle, key: &[u8]) -> bool {
    if !matches!(map.map_type(), MapType::Array | MapType::PercpuArray) {
        return true;
    }
    u32::from_ne_bytes(key[..4].try_into().unwrap()) < map.max_entries()
}

/// Brings the new map up to the old one's changes since `c.first`, and
/// makes the old one's present state the base of the next merge.
fn merge(c: &mut Carried) -> Result<()> {
    // The new map is read only where the old one changed: a whole copy of
    // it would be a third table's worth of memory in the daemon.
    let last = read_all(&c.old)?;
    let value = &c.plan.value;
    let mut updates = Entries::new(c.new.key_size() as usize, c.new.value_size() as usize * per_cpu_values(&c.new)?);
    for (k, l) in last.iter() {
        let first = c.first.get(k);
        if first == Some(l) || !fits(&c.new, k) {
            continue;
        }
        // An entry made during the copy whose key this build cannot hold
        // (`copy` found none before): it cannot be carried.
        if c.plan.key.loses(k).is_some() {
            continue;
        }
        let nk = c.plan.key.apply(k);
        match (first, lookup(&c.new, &nk)?) {
            (Some(f), Some(n)) => updates.push(&nk, &value.merge_all(f, l, &n, c.from)),
            // The new program ended it since: that stands.
            (Some(_), None) => {}
            (None, None) => updates.push(&nk, &value.apply_all(l, c.from)),
            // Both programs made it: the newer stands.
            (None, Some(_)) => {}
        }
    }
    write(&c.new, &updates, MapFlags::ANY)?;
    // Ended by the old program after the copy, and untouched by the new.
    if c.new.map_type().is_hash_map() {
        for (k, f) in c.first.iter() {
            if last.get(k).is_some() {
                continue;
            }
            let nk = c.plan.key.apply(k);
            if lookup(&c.new, &nk)?.is_some_and(|n| n == value.apply_all(f, c.from)) {
                let _ = c.new.delete(&nk);
            }
        }
    }
    c.first = last;
    Ok(())
}

/// One entry's value(s), back to back, as `Entries` holds them.
fn lookup(map: &MapHandle, key: &[u8]) -> Result<Option<Vec<u8>>> {
    Ok(if map.map_type().is_percpu() { map.lookup_percpu(key, MapFlags::ANY)?.map(|v| v.concat()) } else { map.lookup(key, MapFlags::ANY)? })
}


/// Renames each staged map over its pin and removes the staging directory.
fn settle(dir: &PinDir, names: &[String]) -> Result<()> {
    let staging = dir.0.join(STAGING);
    for name in names {
        std::fs::rename(staging.join(name), dir.path(name)).with_context(|| format!("moving the new map {name} into place"))?;
    }
    std::fs::remove_dir(&staging).with_context(|| format!("removing {}", staging.display()))
}

/// Settles an upgrade a process left half-done in `dir`: if the attached
/// program (whose maps are `live_map_ids`) uses the staged maps, they take
/// the pins (the changes of the last milliseconds before its switch are
/// lost); otherwise the old program still runs and the staged maps go.
pub fn recover(dir: &PinDir, live_map_ids: &[u32]) -> Result<bool> {
    let staging = dir.0.join(STAGING);
    if !staging.exists() {
        return Ok(false);
    }
    let staged: Vec<(String, u32)> = std::fs::read_dir(&staging)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let id = MapHandle::from_pinned_path(e.path()).ok()?.info().ok()?.info.id;
            Some((name, id))
        })
        .collect();
    if staged.iter().any(|(_, id)| live_map_ids.contains(id)) {
        settle(dir, &staged.into_iter().map(|(n, _)| n).collect::<Vec<_>>())?;
        return Ok(true);
    }
    remove_pin_dir(&staging)?;
    Ok(false)
}

/// The maps a loaded program uses (an unknown id: none), for [`recover`].
pub fn program_maps(prog_id: u32) -> Vec<u32> {
    let opts = ProgInfoQueryOptions::default().include_map_ids(true);
    ProgInfoIter::with_query_opts(opts).find(|p| p.id == prog_id).map(|p| p.map_ids).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(path: &str, offset: usize, size: usize, shape: &str) -> Leaf {
        Leaf { path: path.into(), offset, size, shape: shape.into() }
    }

    fn flow_v1() -> Layout {
        Layout { size: 12, leaves: vec![leaf("backend", 0, 4, "u32"), leaf("state", 4, 1, "u8"), leaf("seen", 8, 4, "u32")] }
    }

    /// A field inserted in the middle: every other field moved.
    fn flow_v2() -> Layout {
        Layout { size: 16, leaves: vec![leaf("backend", 0, 4, "u32"), leaf("extra", 4, 4, "u32"), leaf("state", 8, 1, "u8"), leaf("seen", 12, 4, "u32")] }
    }

    #[test]
    fn fields_are_carried_by_name_and_new_ones_start_at_zero() {
        let c = Conversion::new("flows", &flow_v1(), &flow_v2(), false).unwrap();
        let old = [1, 0, 0, 0, 7, 0, 0, 0, 9, 9, 0, 0];
        assert_eq!(c.apply(&old), vec![1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 9, 9, 0, 0]);
        // And back: the field only the new layout has is dropped.
        let back = Conversion::new("flows", &flow_v2(), &flow_v1(), false).unwrap();
        assert_eq!(back.apply(&c.apply(&old)), old.to_vec());
    }

    #[test]
    fn a_new_field_may_take_the_bytes_of_padding() {
        let v1 = Layout { size: 8, leaves: vec![leaf("port", 0, 2, "u16"), leaf("proto", 2, 1, "u8"), leaf("pad", 3, 5, "[5]u8")] };
        let v2 = Layout { size: 8, leaves: vec![leaf("port", 0, 2, "u16"), leaf("proto", 2, 1, "u8"), leaf("index", 3, 1, "u8"), leaf("pad", 4, 4, "[4]u8")] };
        let c = Conversion::new("snat", &v1, &v2, false).unwrap();
        assert_eq!(c.apply(&[80, 0, 6, 9, 9, 9, 9, 9]), vec![80, 0, 6, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn a_key_field_that_is_gone_is_carried_only_where_it_is_zero() {
        let v2 = Layout { size: 4, leaves: vec![leaf("port", 0, 2, "u16"), leaf("index", 2, 1, "u8"), leaf("pad", 3, 1, "[1]u8")] };
        let v1 = Layout { size: 4, leaves: vec![leaf("port", 0, 2, "u16"), leaf("pad", 2, 2, "[2]u8")] };
        let back = Conversion::new("snat", &v2, &v1, false).unwrap();
        assert_eq!(back.loses(&[80, 0, 0, 0]), None);
        assert_eq!(back.loses(&[80, 0, 3, 0]), Some("index"));
    }

    #[test]
    fn a_field_that_changed_type_is_refused_with_its_name() {
        let mut v2 = flow_v2();
        v2.leaves[2] = leaf("state", 8, 2, "u16");
        let e = Conversion::new("flows", &flow_v1(), &v2, false).unwrap_err().to_string();
        assert!(e.contains("`state`") && e.contains("u8") && e.contains("u16"), "{e}");
    }

    #[test]
    fn the_old_program_s_late_writes_are_merged_unless_the_new_one_wrote_since() {
        let c = Conversion::new("flows", &flow_v1(), &flow_v2(), false).unwrap();
        let first = [1, 0, 0, 0, 1, 0, 0, 0, 5, 0, 0, 0];
        // After the copy the old program closed the flow (state 2) and saw
        // a packet (seen 6); the new one then saw another (seen 8).
        let last = [1, 0, 0, 0, 2, 0, 0, 0, 6, 0, 0, 0];
        let mut now = c.apply(&first);
        now[12] = 8;
        let merged = c.merge(&first, &last, &now);
        assert_eq!(merged[8], 2, "the old program's close is kept");
        assert_eq!(merged[12], 8, "the new program's later write stands");
    }

    #[test]
    fn per_cpu_counters_add_what_the_old_program_counted_late() {
        let v = Layout { size: 8, leaves: vec![leaf("packets", 0, 8, "u64")] };
        let c = Conversion::new("backend_stats", &v, &v, true).unwrap();
        let first = 100u64.to_le_bytes();
        let last = 103u64.to_le_bytes();
        let now = 2u64.wrapping_add(100).to_le_bytes();
        assert_eq!(u64::from_le_bytes(c.merge(&first, &last, &now).try_into().unwrap()), 105);
    }
}
