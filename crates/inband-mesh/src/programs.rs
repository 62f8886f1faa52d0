//! The mesh programs as the daemon holds them: loading, attaching to the
//! cgroup and to the sockhashes, writing the configuration into the maps,
//! and the pool sockets' entries. docs/mesh.md lists what each map holds.
//!
//! Lifetime: the cgroup programs are attached by links this process holds,
//! so they go when the daemon goes (connects to a service address then
//! fail fast instead of reaching a dead anchor); the maps are pinned under
//! `pin_dir(name)` while it runs, for `inband mesh status`.

use std::mem::MaybeUninit;
use std::net::SocketAddrV4;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject};

use super::config::{fnv, Config};
use crate::bpf::mesh::{MeshSkel, MeshSkelBuilder};
use inband_core::shared as c;
use inband_core::bpfmap::{remove_pin_dir, PinDir};
use inband_core::pod::be_addr;

pub type MeshConfig = c::inband_mesh_config;
pub type ServiceKey = c::inband_mesh_service_key;
pub type ServiceValue = c::inband_mesh_service;
pub type MeshBackend = c::inband_mesh_backend;
pub type Slot = c::inband_mesh_slot;
pub type ConnKey = c::inband_mesh_conn_key;
pub type Conn = c::inband_mesh_conn;

/// Counter names and what they count, in the order of `enum
/// inband_mesh_counter`.
pub const COUNTERS: [(&str, &str); c::INBAND_MESH_COUNTERS as usize] = [
    ("connect_redirected", "connect() calls to a service address sent to the anchor"),
    ("conn_tracked", "Client connections established and tracked"),
    ("conn_table_full", "Client connections not tracked (table full): user space serves them"),
    ("request_kernel", "Requests redirected to a backend socket by the kernel"),
    ("response_kernel", "Responses delivered to the client by the kernel"),
    ("fallback_pipelined", "Connections to user space: more than one request at once"),
    ("fallback_upgrade", "Connections to user space: Upgrade, Expect, HTTP/2 preface or Connection: close"),
    ("fallback_chunked", "Connections to user space: a request body without Content-Length"),
    ("fallback_head_too_big", "Connections to user space: a request head too long for the kernel parser"),
    ("fallback_partial_head", "Connections to user space: a request head not complete in one send"),
    ("fallback_malformed", "Connections to user space: not an HTTP/1.1 request line and headers"),
    ("fallback_no_route", "Connections to user space: no route matched (answered 404)"),
    ("fallback_no_slot", "Connections to user space: every slot of the chosen cluster busy or down"),
    ("fallback_busy", "Connections to user space: the parser's scratch buffer was in use on the CPU"),
    ("response_user", "Responses relayed by the daemon: framing the kernel does not follow"),
    ("response_client_gone", "Responses dropped: the client had closed"),
    ("response_unexpected", "Data on a slot with no request: the slot retired"),
    ("response_excess", "Bytes after a response's end: cut, the slot retired"),
    ("client_gone_in_flight", "Clients that closed with their request at a backend: the slot retired"),
    ("fallback_large_body", "Connections to user space: a request longer than the kernel path carries (2 MiB)"),
    ("client_gone_body", "Clients that closed after an answer that came before their request's body had all gone: the slot retired"),
];
pub fn pin_dir(name: &str) -> PinDir {
    PinDir(inband_core::bpfmap::pin_root().join("mesh").join(name))
}

pub struct Dataplane {
    skel: MeshSkel<'static>,
    _links: Vec<Link>,
    backends: MmapArray<MeshBackend>,
    slots: MmapArray<Slot>,
    pins: PinDir,
}

impl Dataplane {
    pub fn load(cfg: &Config) -> Result<Dataplane> {
        inband_core::bpfmap::require_bpffs()?;
        let cgroup = std::fs::File::open(&cfg.cgroup).with_context(|| {
            format!(
                "opening the cgroup {} (a cgroup v2 directory, e.g. under /sys/fs/cgroup/unified: create it with mkdir \
                 and move the client applications into it)",
                cfg.cgroup.display()
            )
        })?;
        let pins = pin_dir(&cfg.name);
        // Pins left by a daemon that died describe sockets that died with it.
        remove_pin_dir(&pins.0)?;
        std::fs::create_dir_all(&pins.0)
            .with_context(|| format!("creating {}", pins.0.display()))?;
        let storage: &'static mut MaybeUninit<OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = MeshSkelBuilder::default()
            .open(storage)
            .context("opening the mesh BPF object")?;
        for mut map in open.open_object_mut().maps_mut() {
            let name = map.name().to_string_lossy().into_owned();
            if !name.contains('.')
                && !matches!(
                    name.as_str(),
                    "mesh_clients" | "mesh_pool" | "mesh_dst" | "mesh_scratch"
                )
            {
                map.set_pin_path(pins.path(&name))
                    .with_context(|| format!("pin path for {name}"))?;
            }
        }
        let skel = open.load().context(
            "loading the mesh programs (the kernel needs sk_msg, sk_skb verdict, sockops and cgroup connect4 \
             programs, bpf_loop and socket storage: Linux 5.17 or later with CONFIG_BPF_STREAM_PARSER)",
        )?;
        let mut links = Vec::new();
        let fd = cgroup.as_raw_fd();
        for (what, prog) in [
            ("connect4", &skel.progs.mesh_connect4),
            ("getpeername4", &skel.progs.mesh_getpeername4),
            ("sockops", &skel.progs.mesh_sockops),
        ] {
            links.push(prog.attach_cgroup(fd).with_context(|| {
                format!("attaching the {what} program to {}", cfg.cgroup.display())
            })?);
        }
        skel.progs
            .mesh_request
            .attach_sockmap(skel.maps.mesh_clients.as_fd().as_raw_fd())
            .context("attaching the request program to mesh_clients")?;
        skel.progs
            .mesh_response
            .attach_sockmap(skel.maps.mesh_pool.as_fd().as_raw_fd())
            .context("attaching the response program to mesh_pool")?;
        let backends = MmapArray::new(&skel.maps.mesh_backends, c::INBAND_MESH_MAX_BACKENDS)?;
        let slots = MmapArray::new(&skel.maps.mesh_slots, c::INBAND_MESH_MAX_SLOTS)?;
        Ok(Dataplane {
            skel,
            _links: links,
            backends,
            slots,
            pins,
        })
    }

    /// Writes the anchor, the backends' addresses and pools, and every
    /// service with its routes. Slots stay as they are (the pools fill them).
    pub fn install(&self, cfg: &Config) -> Result<()> {
        let anchor = MeshConfig {
            anchor_ip4: be_addr(*cfg.anchor.ip()),
            anchor_port: cfg.anchor.port().to_be() as u32,
        };
        inband_core::bpfmap::put(&self.skel.maps.mesh_config, &0u32, &anchor)?;
        let backends = cfg.backends();
        for (i, addr) in backends.iter().enumerate() {
            let b = self.backend(i as u32);
            // SAFETY: the daemon is the only writer of these fields; the
            // programs read them (a torn read picks a stale pool, which
            // claim() bounds by INBAND_MESH_MAX_POOL).
            unsafe {
                (*b).ip4 = be_addr(*addr.ip());
                (*b).port = addr.port() as u32;
                (*b).slot_base = i as u32 * cfg.pool_max();
                // A pool grown under load keeps its size across a reload.
                (*b).pool = (*b).pool.max(cfg.pool);
            }
        }
        for svc in &cfg.services {
            let key = service_key(svc.address);
            let mut value = ServiceValue {
                id: 0,
                n_routes: 0,
                ..Default::default()
            };
            value.id = cfg
                .services
                .iter()
                .position(|s| s.address == svc.address)
                .unwrap() as u32;
            let routes = svc.effective_routes();
            value.n_routes = routes.len() as u32;
            value.header_routes = routes.iter().filter(|r| r.header.is_some()).count() as u32;
            for (r, route) in routes.iter().enumerate() {
                let rt = &mut value.routes[r];
                rt.prefix_len = route.path_prefix.len() as u32;
                for (i, b) in route.path_prefix.bytes().enumerate() {
                    rt.prefix[i] = b as _;
                }
                if let Some(h) = &route.header {
                    rt.hname_len = h.name.len() as u32;
                    rt.hvalue_len = h.value.len() as u32;
                    rt.hname_hash = fnv(h.name.as_bytes(), true);
                    rt.hvalue_hash = fnv(h.value.as_bytes(), false);
                    for (i, b) in h.name.bytes().enumerate() {
                        rt.hname[i] = b as _;
                    }
                    for (i, b) in h.value.bytes().enumerate() {
                        rt.hvalue[i] = b as _;
                    }
                }
                rt.policy = route.policy.unwrap_or_default().as_c();
                rt.timeout_ms = route.timeout_ms;
                rt.total_weight = route.clusters.values().sum();
                for (s, (cluster, weight)) in route.clusters.iter().enumerate() {
                    let list = svc
                        .cluster(cluster)
                        .expect("Config::check: routes name clusters of their service");
                    let split = &mut rt.splits[s];
                    split.weight = *weight;
                    split.n_backends = list.len() as u32;
                    for (j, addr) in list.iter().enumerate() {
                        split.backends[j] = backends.iter().position(|b| b == addr).unwrap() as u32;
                    }
                }
            }
            inband_core::bpfmap::put(&self.skel.maps.mesh_services, &key, &value)?;
        }
        Ok(())
    }

    /// A service no longer in the config: new connects to it go to its
    /// address as they would without the mesh; open ones fall back to the
    /// daemon at their next request.
    pub fn remove_service(&self, addr: SocketAddrV4) {
        let _ = inband_core::bpfmap::delete(&self.skel.maps.mesh_services, &service_key(addr));
    }

    /// Lets claims use the first `n` slots of the backend's range (the
    /// slots past the old size are DOWN until their sockets connect).
    pub fn set_pool(&self, backend: u32, n: u32) {
        // SAFETY: an aligned u32 inside the mapped array.
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.backend(backend)).pool)) }
            .store(n, Ordering::Release);
    }

    /// Marks a backend up or down: a down backend's slots are never claimed.
    pub fn set_up(&self, backend: u32, up: bool) {
        // SAFETY: an aligned u32 inside the mapped array.
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.backend(backend)).up)) }
            .store(up as u32, Ordering::Release);
    }

    pub fn backend_snapshot(&self, backend: u32) -> MeshBackend {
        // SAFETY: a plain copy; fields may be mid-update, which a snapshot tolerates.
        unsafe { std::ptr::read_volatile(self.backend(backend)) }
    }

    /// One fewer request in flight to the backend (a response the daemon relayed).
    pub fn backend_done(&self, backend: u32) {
        // SAFETY: an aligned i32 inside the mapped array; the programs use atomics on it too.
        unsafe { AtomicI32::from_ptr(std::ptr::addr_of_mut!((*self.backend(backend)).in_flight)) }
            .fetch_sub(1, Ordering::AcqRel);
    }

    pub fn slot_snapshot(&self, slot: u32) -> Slot {
        // SAFETY: as backend_snapshot.
        unsafe { std::ptr::read_volatile(self.slots.at(slot)) }
    }

    pub fn slot_state(&self, slot: u32) -> &AtomicU32 {
        // SAFETY: an aligned u32 inside the mapped array, alive as long as self.
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.slots.at(slot)).state)) }
    }

    /// Puts a connected pool socket in service as `slot` of `backend`.
    pub fn insert_pool_socket(&self, slot: u32, backend: u32, sock: BorrowedFd) -> Result<u64> {
        let cookie = socket_cookie(sock)?;
        let s = self.slots.at(slot);
        // SAFETY: the slot is DOWN: no program writes it until it is FREE.
        unsafe {
            (*s).backend = backend;
            (*s).client_cookie = 0;
            (*s).body_phase = 0;
        }
        self.skel
            .maps
            .mesh_slot_of
            .update(&cookie.to_ne_bytes(), &slot.to_ne_bytes(), MapFlags::ANY)
            .context("adding to mesh_slot_of")?;
        let fd = sock.as_raw_fd() as u64;
        self.skel
            .maps
            .mesh_pool
            .update(&slot.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
            .context("adding the socket to mesh_pool")?;
        self.slot_state(slot)
            .store(c::INBAND_MESH_SLOT_FREE, Ordering::Release);
        Ok(cookie)
    }

    /// Takes a slot out of service before its socket is closed. Returns the
    /// state it had.
    pub fn remove_pool_socket(&self, slot: u32, cookie: u64) -> u32 {
        let was = self
            .slot_state(slot)
            .swap(c::INBAND_MESH_SLOT_DOWN, Ordering::AcqRel);
        let _ = inband_core::bpfmap::delete(&self.skel.maps.mesh_pool, &slot);
        let _ = inband_core::bpfmap::delete(&self.skel.maps.mesh_slot_of, &cookie);
        was
    }

    pub fn conn(&self, peer: SocketAddrV4) -> Result<Option<Conn>> {
        inband_core::bpfmap::get(&self.skel.maps.mesh_conns, &conn_key(peer))
    }

    /// Whether the client's latest kernel-path request still has a slot.
    pub fn request_in_flight(&self, conn: &Conn) -> bool {
        if conn.last_slot == 0 {
            return false;
        }
        let s = self.slot_snapshot(conn.last_slot - 1);
        s.client_cookie == conn.cookie
            && matches!(
                s.state,
                c::INBAND_MESH_SLOT_KERNEL | c::INBAND_MESH_SLOT_USER
            )
    }

    /// Slots the programs want the daemon to look at (u32 each).
    pub fn events(&self) -> &dyn MapCore {
        &self.skel.maps.mesh_events
    }

    pub fn pins(&self) -> &PinDir {
        &self.pins
    }

    /// Each program, by our name, for its run counts (`bpf_stats`).
    pub fn programs(&self) -> Result<Vec<(&'static str, std::os::fd::OwnedFd)>> {
        let p = &self.skel.progs;
        [
            ("connect4", p.mesh_connect4.as_fd()),
            ("getpeername4", p.mesh_getpeername4.as_fd()),
            ("sockops", p.mesh_sockops.as_fd()),
            ("request", p.mesh_request.as_fd()),
            ("response", p.mesh_response.as_fd()),
        ]
        .into_iter()
        .map(|(name, fd)| Ok((name, fd.try_clone_to_owned().with_context(|| format!("duplicating the {name} program's fd"))?)))
        .collect()
    }

    fn backend(&self, i: u32) -> *mut MeshBackend {
        self.backends.at(i)
    }
}

impl Drop for Dataplane {
    fn drop(&mut self) {
        let _ = remove_pin_dir(&self.pins.0);
    }
}

pub fn service_key(addr: SocketAddrV4) -> ServiceKey {
    ServiceKey {
        ip4: be_addr(*addr.ip()),
        port: addr.port().to_be() as u32,
    }
}

pub fn conn_key(peer: SocketAddrV4) -> ConnKey {
    ConnKey {
        ip4: be_addr(*peer.ip()),
        port: peer.port() as u32,
    }
}

pub fn read_counters(map: &dyn MapCore) -> Result<Vec<(&'static str, u64)>> {
    COUNTERS
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let per_cpu: Vec<u64> = inband_core::bpfmap::get_percpu(map, &(i as u32))?;
            Ok((*name, per_cpu.iter().sum()))
        })
        .collect()
}

fn socket_cookie(sock: BorrowedFd) -> Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: SO_COOKIE writes a u64 into the buffer whose size we pass.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        bail!("SO_COOKIE: {}", std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// A BPF array map memory-mapped into this process (BPF_F_MMAPABLE): the
/// daemon changes slot states and in-flight counts with the same atomics
/// the programs use, which map updates through the syscall could not.
struct MmapArray<T> {
    ptr: *mut T,
    len: u32,
    bytes: usize,
}

impl<T> MmapArray<T> {
    fn new(map: &dyn MapCore, len: u32) -> Result<Self> {
        assert_eq!(
            std::mem::size_of::<T>() % 8,
            0,
            "array values are laid out at multiples of 8 bytes"
        );
        let page = 4096;
        let bytes = (std::mem::size_of::<T>() * len as usize).div_ceil(page) * page;
        // SAFETY: mapping a BPF_F_MMAPABLE array's fd, whose size is `bytes`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "mapping {}: {}",
                map.name().to_string_lossy(),
                std::io::Error::last_os_error()
            );
        }
        Ok(MmapArray {
            ptr: ptr.cast(),
            len,
            bytes,
        })
    }

    fn at(&self, i: u32) -> *mut T {
        assert!(i < self.len, "index {i} past the array's {}", self.len);
        // SAFETY: in bounds of the mapping.
        unsafe { self.ptr.add(i as usize) }
    }
}

impl<T> Drop for MmapArray<T> {
    fn drop(&mut self) {
        // SAFETY: unmapping what new() mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}

// SAFETY: the mapping is shared memory accessed through atomics or
// snapshot copies; the pointer itself is never reassigned.
unsafe impl<T> Send for MmapArray<T> {}
unsafe impl<T> Sync for MmapArray<T> {}

/// Nanoseconds on the clock bpf_ktime_get_ns() reads (CLOCK_MONOTONIC).
pub fn ktime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the struct we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A backend's address, requests in flight and requests sent, for status.
pub fn backend_line(b: &MeshBackend) -> (SocketAddrV4, i32, u64) {
    let ip = std::net::Ipv4Addr::from(u32::from_be(b.ip4));
    (
        SocketAddrV4::new(ip, b.port as u16),
        b.in_flight,
        b.requests,
    )
}
