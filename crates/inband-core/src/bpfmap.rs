//! Typed access to BPF maps by their `Pod` key and value types, for the
//! daemons (through the skeleton's maps) and for `inband status` (through
//! pinned paths, with no daemon running).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType, Object, RingBufferBuilder};

use crate::pod::Pod;

pub fn get<K: Pod, V: Pod>(map: &dyn MapCore, key: &K) -> Result<Option<V>> {
    Ok(map.lookup(key.as_bytes(), MapFlags::ANY).with_context(|| lookup_err(map))?.map(|b| V::from_bytes(&b)))
}

pub fn put<K: Pod, V: Pod>(map: &dyn MapCore, key: &K, value: &V) -> Result<()> {
    map.update(key.as_bytes(), value.as_bytes(), MapFlags::ANY)
        .with_context(|| format!("updating map {}", map.name().to_string_lossy()))
}

/// Writes `keys[i]` → `values[i]` in one system call (a Maglev table is
/// 65,537 entries: one call per entry took most of an apply).
pub fn put_batch<K: Pod, V: Pod>(map: &dyn MapCore, keys: &[K], values: &[V]) -> Result<()> {
    anyhow::ensure!(keys.len() == values.len() && !keys.is_empty(), "a batch needs as many keys as values, at least one");
    let k: Vec<u8> = keys.iter().flat_map(|x| x.as_bytes().to_vec()).collect();
    let v: Vec<u8> = values.iter().flat_map(|x| x.as_bytes().to_vec()).collect();
    map.update_batch(&k, &v, keys.len() as u32, MapFlags::ANY, MapFlags::ANY)
        .with_context(|| format!("updating map {} in a batch", map.name().to_string_lossy()))
}

/// Deletes `key`; a key that is already gone is not an error.
pub fn delete<K: Pod>(map: &dyn MapCore, key: &K) -> Result<()> {
    match map.delete(key.as_bytes()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("deleting from map {}", map.name().to_string_lossy())),
    }
}

/// Returns every map of a loaded object to its state at load: tables
/// emptied, arrays and `.bss` zeroed, rings drained; `.rodata` is left as
/// it is (frozen at load), and so are storages attached to sockets or tasks. Packet fixtures reuse one loaded program this
/// way rather than paying the verifier for each test.
pub fn reset_maps(object: &Object) -> Result<()> {
    let cpus = libbpf_rs::num_possible_cpus()?;
    for map in object.maps() {
        let name = map.name().to_string_lossy().into_owned();
        if name.ends_with(".rodata") {
            continue;
        }
        anyhow::ensure!(!name.ends_with(".data"), "map {name} holds initialised globals, which a reset would lose");
        match map.map_type() {
            MapType::Hash | MapType::LruHash | MapType::PercpuHash | MapType::LruPercpuHash | MapType::LpmTrie => {
                let keys: Vec<Vec<u8>> = map.keys().collect();
                for k in keys {
                    map.delete(&k).with_context(|| format!("emptying map {name}"))?;
                }
            }
            MapType::Array => {
                let n = map.max_entries();
                let keys: Vec<u8> = (0..n).flat_map(u32::to_ne_bytes).collect();
                let zero = vec![0u8; map.value_size() as usize * n as usize];
                map.update_batch(&keys, &zero, n, MapFlags::ANY, MapFlags::ANY).with_context(|| format!("zeroing map {name}"))?;
            }
            MapType::PercpuArray => {
                let zero = vec![vec![0u8; map.value_size() as usize]; cpus];
                for i in 0..map.max_entries() {
                    map.update_percpu(&i.to_ne_bytes(), &zero, MapFlags::ANY).with_context(|| format!("zeroing map {name}"))?;
                }
            }
            MapType::RingBuf => {
                let mut rb = RingBufferBuilder::new();
                rb.add(&map, |_: &[u8]| 0)?;
                rb.build()?.consume().with_context(|| format!("draining map {name}"))?;
            }
            // Their entries belong to sockets and tasks, and go with them.
            MapType::SkStorage | MapType::TaskStorage | MapType::InodeStorage => {}
            other => anyhow::bail!("map {name} is a {other:?}, which reset_maps does not know how to clear"),
        }
    }
    Ok(())
}

/// Every CPU's value of a per-CPU map entry.
pub fn get_percpu<K: Pod, V: Pod>(map: &dyn MapCore, key: &K) -> Result<Vec<V>> {
    Ok(map
        .lookup_percpu(key.as_bytes(), MapFlags::ANY)
        .with_context(|| lookup_err(map))?
        .unwrap_or_default()
        .iter()
        .map(|b| V::from_bytes(b))
        .collect())
}

/// Adds `delta` to a per-CPU u64 counter from user space (into CPU 0's
/// slot, as the sum is what is read). Callers serialize their own writes:
/// a read-modify-write of the whole entry.
pub fn add_percpu<K: Pod>(map: &dyn MapCore, key: &K, delta: u64) -> Result<()> {
    let mut values: Vec<u64> = get_percpu(map, key)?;
    let Some(first) = values.first_mut() else { return Ok(()) };
    *first += delta;
    let bytes: Vec<Vec<u8>> = values.iter().map(|v| v.to_ne_bytes().to_vec()).collect();
    map.update_percpu(key.as_bytes(), &bytes, MapFlags::ANY)
        .with_context(|| format!("updating map {}", map.name().to_string_lossy()))
}

/// All (key, value) pairs of a hash map. Entries deleted during the walk are
/// skipped, as the kernel may evict LRU entries at any time.
pub fn entries<K: Pod, V: Pod>(map: &dyn MapCore) -> Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for k in map.keys() {
        if let Some(v) = map.lookup(&k, MapFlags::ANY).with_context(|| lookup_err(map))? {
            out.push((K::from_bytes(&k), V::from_bytes(&v)));
        }
    }
    Ok(out)
}

/// Every (index, value) of an array map, read `batch` entries a system
/// call (BPF_MAP_LOOKUP_BATCH): a walk of a large array one lookup per
/// entry pays a system call for each, and the balancer walks its 16,384
/// backend slots every second.
pub fn array_entries<V: Pod>(map: &dyn MapCore, batch: u32) -> Result<Vec<(u32, V)>> {
    let entries = map.lookup_batch(batch, MapFlags::ANY, MapFlags::ANY).with_context(|| lookup_err(map))?;
    Ok(entries.map(|(k, v)| (u32::from_ne_bytes(k[..4].try_into().expect("an array's 4-byte key")), V::from_bytes(&v))).collect())
}

pub fn count(map: &dyn MapCore) -> usize {
    map.keys().count()
}

fn lookup_err(map: &dyn MapCore) -> String {
    format!("reading map {}", map.name().to_string_lossy())
}

/// A directory of maps pinned by one loaded program instance.
pub struct PinDir(pub PathBuf);

impl PinDir {
    pub fn path(&self, map: &str) -> PathBuf {
        self.0.join(map)
    }

    pub fn open(&self, map: &str) -> Result<MapHandle> {
        let p = self.path(map);
        MapHandle::from_pinned_path(&p).with_context(|| format!("opening pinned map {}", p.display()))
    }

    pub fn exists(&self) -> bool {
        self.0.is_dir()
    }
}

/// Where this network namespace's pins live. bpffs is shared by every
/// namespace of the host, so components in different network namespaces
/// (a testbed puts a balancer and several agents on one machine) must not
/// share paths: inside a named namespace (`ip netns add NAME`) the pins go
/// under `netns/NAME/`.
pub fn pin_root() -> PathBuf {
    match current_netns_name() {
        Some(name) => pin_root_of(&name),
        None => PathBuf::from("/sys/fs/bpf/inband"),
    }
}

/// The pin root of the named network namespace `name`.
pub fn pin_root_of(name: &str) -> PathBuf {
    PathBuf::from("/sys/fs/bpf/inband/netns").join(name)
}

/// The name under /run/netns of the network namespace this process is in.
pub fn current_netns_name() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let me = std::fs::metadata("/proc/self/ns/net").ok()?;
    std::fs::read_dir("/run/netns").ok()?.filter_map(|e| e.ok()).find_map(|e| {
        let m = std::fs::metadata(e.path()).ok()?;
        (m.ino() == me.ino() && m.dev() == me.dev()).then(|| e.file_name().to_string_lossy().into_owned())
    })
}

/// Refuses to go on without bpffs, which pinning needs.
pub fn require_bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    if mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 2 && f[1] == "/sys/fs/bpf" && f[2] == "bpf"
    }) {
        Ok(())
    } else {
        anyhow::bail!(
            "bpffs is not mounted at /sys/fs/bpf: run `mount -t bpf bpf /sys/fs/bpf` (as root) and retry. \
             Under `ip netns exec` (which mounts a private /sys) use `nsenter --net=/run/netns/NAME` instead, \
             so the pins are visible to later commands"
        )
    }
}

fn remove_tree(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        // A directory inside: an upgrade's staged maps (map_upgrade).
        if path.is_dir() {
            remove_tree(&path)?;
        } else {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    std::fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))
}

pub fn remove_pin_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        remove_tree(dir)?;
    }
    // Empty parents (inband/lb, inband/netns/NAME, ...) go too, so a clean
    // detach leaves /sys/fs/bpf as it was.
    let mut parent = dir.parent();
    while let Some(p) = parent {
        if p == Path::new("/sys/fs/bpf") || std::fs::remove_dir(p).is_err() {
            break;
        }
        parent = p.parent();
    }
    Ok(())
}
