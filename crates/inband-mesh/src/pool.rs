//! The pools: one task per slot keeps one pre-connected socket to its
//! backend in mesh_pool, relays the responses the kernel path hands over,
//! and retires the socket when it breaks, times out or is told to close.
//!
//! The daemon does not poll the pool sockets: the kernel would wake it for
//! every response it redirects. A slot task sleeps until the response
//! program names its slot (mesh_events: a response handed over, bytes no
//! request asked for) or the watchdog does (the program retired it, its
//! request timed out, its connection is no longer established).
//!
//! Slot lifecycle (docs/mesh.md): DOWN (connecting) -> FREE (in mesh_pool)
//! -> KERNEL (claimed by a request) -> FREE after the response, or USER
//! (the daemon relays) -> FREE; any error -> DOWN, the socket is closed and
//! a new one connected. A backend with no connected slot is marked down, so
//! requests go to the others of its cluster.

use std::net::SocketAddrV4;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Result;
use tokio::net::TcpStream;
use tracing::{debug, info, warn};

use super::state::MeshState;
use super::relay::{self, End};
use inband_core::shared as c;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// How often the watchdog looks at every slot.
const TICK: Duration = Duration::from_millis(50);

/// Why a pool socket was retired.
#[derive(Debug)]
enum Retire {
    /// The program retired it (Connection: close, bytes past the response).
    Program,
    Closed,
    Unexpected,
    Timeout,
    Broken(String),
    /// A relayed response said it closes; `close_client` as in relay::End.
    Relayed {
        close_client: bool,
    },
}

pub async fn run_slot(sh: Rc<MeshState>, backend: u32, addr: SocketAddrV4, slot: u32) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let failure = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => match s.into_std() {
                Ok(s) => Ok(s),
                Err(e) => Err(e.to_string()),
            },
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("timed out".to_string()),
        };
        let stream = match failure {
            Ok(s) => s,
            Err(why) => {
                sh.health.connect_failed(&sh.dp, backend, slot, &why);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let _ = stream.set_nodelay(true);
        // What INBAND_MESH_KERNEL_REQUEST_MAX relies on (mesh/consts.h): a
        // request's body must fit into the send buffer in one push.
        if let Err(e) = force_send_buffer(&stream, c::INBAND_MESH_POOL_SNDBUF) {
            warn!(slot, %addr, "pool socket's send buffer not set, the slot is not used: {e}");
            tokio::time::sleep(BACKOFF_MAX).await;
            continue;
        }
        let cookie = match sh.dp.insert_pool_socket(slot, backend, stream.as_fd()) {
            Ok(c) => c,
            Err(e) => {
                warn!(slot, %addr, "pool socket not added: {e:#}");
                tokio::time::sleep(BACKOFF_MAX).await;
                continue;
            }
        };
        sh.pool.fds.borrow_mut()[slot as usize] = stream.as_raw_fd();
        sh.health.connected(&sh.dp, backend);
        let mut stream = Some(stream);
        let why = watch(&sh, slot, &mut stream).await;
        sh.pool.fds.borrow_mut()[slot as usize] = -1;
        let snapshot = sh.dp.slot_snapshot(slot);
        let was = sh.dp.remove_pool_socket(slot, cookie);
        sh.health.disconnected(&sh.dp, backend);
        match &why {
            Retire::Broken(e) => warn!(slot, %addr, "pool socket broken: {e}"),
            _ => debug!(slot, %addr, ?why, "pool socket retired"),
        }
        match why {
            Retire::Relayed { close_client } if close_client => sh.close_client(&snapshot),
            _ if matches!(was, c::INBAND_MESH_SLOT_KERNEL | c::INBAND_MESH_SLOT_USER) => {
                // A request was in flight: its client gets an error, not a hang.
                sh.dp.backend_done(backend);
                let status = if matches!(why, Retire::Timeout) {
                    504
                } else {
                    502
                };
                sh.fail_client(&snapshot, status).await;
            }
            _ => {}
        }
        drop(stream);
    }
}

/// Sets a socket's send buffer to `bytes` past net.core.wmem_max
/// (SO_SNDBUFFORCE: the daemon has CAP_NET_ADMIN; SO_SNDBUF would be cut
/// to wmem_max, 208 KiB by default) and checks what the kernel took (it
/// doubles the value for its own overhead). No crate offers the FORCE
/// variant, hence libc.
fn force_send_buffer(s: &std::net::TcpStream, bytes: u32) -> std::io::Result<()> {
    let fd = s.as_raw_fd();
    let v = bytes as libc::c_int;
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: setsockopt(2) with a pointer to a c_int and its size.
    if unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, (&v as *const libc::c_int).cast(), len) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut got: libc::c_int = 0;
    let mut got_len = len;
    // SAFETY: getsockopt(2) into a c_int of `got_len` bytes.
    if unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, (&mut got as *mut libc::c_int).cast(), &mut got_len) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if (got as u32) < bytes {
        return Err(std::io::Error::other(format!("the kernel took {got} bytes, not {bytes}")));
    }
    Ok(())
}

/// Sleeps until the slot is named, then looks: returns when the socket
/// must go.
async fn watch(sh: &Rc<MeshState>, slot: u32, stream: &mut Option<std::net::TcpStream>) -> Retire {
    loop {
        sh.pool.wake[slot as usize].notified().await;
        let Some(std) = stream.take() else {
            return Retire::Closed;
        };
        let s = sh.dp.slot_snapshot(slot);
        if s.state == c::INBAND_MESH_SLOT_USER {
            let relayed = match TcpStream::from_std(std) {
                Ok(t) => {
                    let r = relay_one(sh, slot, &t).await;
                    match t.into_std() {
                        Ok(std) => {
                            *stream = Some(std);
                            r
                        }
                        Err(e) => Some(Retire::Broken(e.to_string())),
                    }
                }
                Err(e) => Some(Retire::Broken(e.to_string())),
            };
            match relayed {
                Some(end) => return end,
                None => continue,
            }
        }
        let fd = std.as_raw_fd();
        *stream = Some(std);
        match s.state {
            c::INBAND_MESH_SLOT_DOWN => return Retire::Program,
            c::INBAND_MESH_SLOT_KERNEL | c::INBAND_MESH_SLOT_BODY if timed_out(&s) => return Retire::Timeout,
            _ => {}
        }
        if !established(fd) {
            return Retire::Closed;
        }
        // Bytes nobody asked for: the stream is out of step.
        if s.state == c::INBAND_MESH_SLOT_FREE && peek(fd).unwrap_or(0) > 0 {
            return Retire::Unexpected;
        }
    }
}

/// Every TICK, names the slots whose request timed out, that the program
/// retired, or whose connection ended; and grows the pools of backends
/// whose every socket is busy.
pub async fn watchdog(sh: Rc<MeshState>) {
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        for b in 0..sh.backends.len() as u32 {
            grow_if_busy(&sh, b);
        }
        let fds = sh.pool.fds.borrow().clone();
        for (slot, fd) in fds.into_iter().enumerate() {
            if fd < 0 {
                continue;
            }
            let s = sh.dp.slot_snapshot(slot as u32);
            let busy = matches!(
                s.state,
                c::INBAND_MESH_SLOT_KERNEL | c::INBAND_MESH_SLOT_USER | c::INBAND_MESH_SLOT_BODY
            );
            // USER too: a handover whose event was lost is relayed all the same.
            if matches!(s.state, c::INBAND_MESH_SLOT_DOWN | c::INBAND_MESH_SLOT_USER)
                || (busy && timed_out(&s))
                || !established(fd)
            {
                sh.pool.wake(slot as u32);
            }
        }
    }
}

/// Grows a backend's pool, up to pool_max, when requests found none of its
/// slots free since the last tick (by as many as found none, at least a
/// quarter more), or when every slot carries a request now. A burst above
/// the pool would otherwise send connections to the user-space path.
fn grow_if_busy(sh: &Rc<MeshState>, backend: u32) {
    let be = sh.dp.backend_snapshot(backend);
    let missed = {
        let mut seen = sh.pool.no_slot_seen.borrow_mut();
        let m = be.no_slot.wrapping_sub(seen[backend as usize]);
        seen[backend as usize] = be.no_slot;
        m
    };
    if be.pool >= sh.pool_max || be.up == 0 {
        return;
    }
    let busy = (0..be.pool).all(|k| {
        matches!(
            sh.dp.slot_snapshot(be.slot_base + k).state,
            c::INBAND_MESH_SLOT_KERNEL | c::INBAND_MESH_SLOT_USER | c::INBAND_MESH_SLOT_BODY
        )
    });
    if missed == 0 && !busy {
        return;
    }
    let grown = (be.pool + (be.pool / 4).max(missed).max(1)).min(sh.pool_max);
    let addr = sh.backends[backend as usize];
    for k in be.pool..grown {
        tokio::task::spawn_local(run_slot(sh.clone(), backend, addr, be.slot_base + k));
    }
    sh.dp.set_pool(backend, grown);
    info!(%addr, from = be.pool, to = grown, missed, "pool grown: requests found every socket busy");
}

/// Wakes the slots the response program names in mesh_events.
pub async fn events(sh: Rc<MeshState>) -> Result<()> {
    let waker = sh.clone();
    let mut builder = libbpf_rs::RingBufferBuilder::new();
    builder.add(sh.dp.events(), move |data: &[u8]| {
        if let Ok(b) = <[u8; 4]>::try_from(&data[..4.min(data.len())]) {
            waker.pool.wake(u32::from_ne_bytes(b));
        }
        0
    })?;
    let rb = builder.build()?;
    // SAFETY: the ring buffer's epoll fd stays open while `rb` lives, which
    // outlives `fd` (both are dropped at the end of this function).
    let fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            rb.epoll_fd(),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| anyhow::anyhow!("watching mesh_events: {e}"))?;
    loop {
        let mut guard = fd.readable().await?;
        rb.consume()?;
        guard.clear_ready();
    }
}

fn timed_out(s: &super::programs::Slot) -> bool {
    s.timeout_ms != 0
        && super::programs::ktime_ns().saturating_sub(s.started_ns)
            > s.timeout_ms as u64 * 1_000_000
}

fn established(fd: RawFd) -> bool {
    // SAFETY: TCP_INFO writes at most `len` bytes into the struct we own.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    rc == 0 && info.tcpi_state == 1 /* TCP_ESTABLISHED */
}

fn peek(fd: RawFd) -> std::io::Result<usize> {
    let mut buf = [0u8; 1];
    // SAFETY: recv into a buffer we own, with its length.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Relays the response the program handed over; None when the slot can
/// take the next request.
async fn relay_one(sh: &Rc<MeshState>, slot: u32, stream: &TcpStream) -> Option<Retire> {
    let s = sh.dp.slot_snapshot(slot);
    let client = sh.client(&s);
    let mut sent = 0;
    let budget = if s.timeout_ms == 0 {
        Duration::from_secs(3600)
    } else {
        Duration::from_millis(s.timeout_ms as u64).saturating_sub(Duration::from_nanos(
            super::programs::ktime_ns().saturating_sub(s.started_ns),
        ))
    };
    let outcome = match &client {
        Some(cl) => {
            let mut w = cl.writer.lock().await;
            tokio::time::timeout(
                budget,
                relay::relay(stream, Some(&mut *w), s.head_request != 0, &mut sent),
            )
            .await
        }
        None => {
            tokio::time::timeout(
                budget,
                relay::relay::<tokio::net::tcp::OwnedWriteHalf>(
                    stream,
                    None,
                    s.head_request != 0,
                    &mut sent,
                ),
            )
            .await
        }
    };
    let failed = |why: Retire| {
        if sent > 0 {
            // Part of the response is with the client: only a reset tells it.
            if let Some(cl) = &client {
                cl.reset();
            }
            sh.dp.backend_done(s.backend);
            sh.dp
                .slot_state(slot)
                .store(c::INBAND_MESH_SLOT_DOWN, Ordering::Release);
        }
        Some(why)
    };
    match outcome {
        Err(_) => failed(Retire::Timeout),
        Ok(Err(e)) => failed(Retire::Broken(format!("{e:#}"))),
        Ok(Ok(End::Reusable)) => {
            sh.dp.backend_done(s.backend);
            // As the response program does: a body still on its way keeps
            // the slot for its client (SLOT_BODY in bpf/include/inband/mesh/types.h).
            let next = if s.body_follows != 0 {
                c::INBAND_MESH_SLOT_BODY
            } else {
                c::INBAND_MESH_SLOT_FREE
            };
            sh.dp.slot_state(slot).store(next, Ordering::Release);
            None
        }
        Ok(Ok(End::Retire { close_client })) => {
            sh.dp.backend_done(s.backend);
            // Not in flight any more: run_slot must not fail the client.
            sh.dp
                .slot_state(slot)
                .store(c::INBAND_MESH_SLOT_DOWN, Ordering::Release);
            Some(Retire::Relayed { close_client })
        }
    }
}
