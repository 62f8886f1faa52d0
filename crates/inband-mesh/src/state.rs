//! What the daemon's tasks share (one thread, so `Rc` and `RefCell`): the
//! data path, the config, the clients on the anchor, the backends' health
//! and the pools' wake-ups. The anchor, the pools and the health checks
//! act through it; the daemon builds it.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use std::rc::Rc;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;
use tracing::{info, warn};

use super::config::Config;
use super::programs::{Dataplane, Slot};

pub struct MeshState {
    pub dp: Dataplane,
    pub cfg: RefCell<Config>,
    pub clients: RefCell<HashMap<SocketAddrV4, Rc<Client>>>,
    pub health: Health,
    pub pool: Pool,
    /// mesh_backends' entries, by index.
    pub backends: Vec<SocketAddrV4>,
    pub pool_max: u32,
}

/// The daemon's end of a client's anchor connection: the way back to a
/// client for what the daemon relays or answers.
pub struct Client {
    pub writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Wakes the connection's task to close it (with a reset if `rst`).
    pub close: Notify,
    pub rst: Cell<bool>,
    pub fd: RawFd,
}

impl Client {
    /// Ends the connection with a reset: the client sees an error, never a
    /// silently short response.
    pub fn reset(&self) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt on the connection's fd with a correctly sized struct.
        unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        self.rst.set(true);
        self.close.notify_one();
    }
}

impl MeshState {
    pub fn client(&self, s: &Slot) -> Option<Rc<Client>> {
        let peer = SocketAddrV4::new(
            std::net::Ipv4Addr::from(u32::from_be(s.client_ip4)),
            s.client_port as u16,
        );
        self.clients.borrow().get(&peer).cloned()
    }

    /// A request failed at the backend: a 502/504 if nothing of the response
    /// reached the client yet, otherwise a reset.
    pub async fn fail_client(&self, s: &Slot, status: u16) {
        let Some(cl) = self.client(s) else { return };
        if s.to_client > 0 {
            cl.reset();
            return;
        }
        let body = if status == 504 {
            "upstream timed out\n"
        } else {
            "upstream connection failed\n"
        };
        let reason = if status == 504 {
            "Gateway Timeout"
        } else {
            "Bad Gateway"
        };
        let msg = format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nvia: 1.1 inband-mesh\r\n\r\n{body}",
            body.len()
        );
        let mut w = cl.writer.lock().await;
        if w.write_all(msg.as_bytes()).await.is_err() {
            cl.reset();
        }
    }

    /// The response ended with the backend's connection: so must the client's.
    pub fn close_client(&self, s: &Slot) {
        if let Some(cl) = self.client(s) {
            cl.close.notify_one();
        }
    }
}

/// A backend is up while it has a connected slot and, with active health
/// checks, while they pass.
pub struct Health {
    connected: RefCell<Vec<u32>>,
    passing: RefCell<Vec<bool>>,
}

impl Health {
    pub fn new(n: usize) -> Health {
        Health {
            connected: RefCell::new(vec![0; n]),
            passing: RefCell::new(vec![true; n]),
        }
    }

    fn update(&self, dp: &Dataplane, backend: u32) {
        let up = self.connected.borrow()[backend as usize] > 0
            && self.passing.borrow()[backend as usize];
        if up != (dp.backend_snapshot(backend).up != 0) {
            dp.set_up(backend, up);
            info!(backend, up, "backend state");
        }
    }

    pub fn connected(&self, dp: &Dataplane, backend: u32) {
        self.connected.borrow_mut()[backend as usize] += 1;
        self.update(dp, backend);
    }

    pub fn disconnected(&self, dp: &Dataplane, backend: u32) {
        let mut c = self.connected.borrow_mut();
        c[backend as usize] = c[backend as usize].saturating_sub(1);
        drop(c);
        self.update(dp, backend);
    }

    pub fn checked(&self, dp: &Dataplane, backend: u32, passing: bool) {
        self.passing.borrow_mut()[backend as usize] = passing;
        self.update(dp, backend);
    }

    pub fn connect_failed(&self, dp: &Dataplane, backend: u32, slot: u32, why: &str) {
        if self.connected.borrow()[backend as usize] == 0 {
            self.update(dp, backend);
            // Once per slot's first attempt is enough noise.
            if slot == dp.backend_snapshot(backend).slot_base {
                warn!(backend, "backend unreachable: {why}");
            }
        }
    }
}

/// Wake-ups for the slot tasks, each slot's socket for the watchdog, and
/// each backend's `no_slot` count at the last tick.
pub struct Pool {
    pub wake: Vec<Notify>,
    pub fds: RefCell<Vec<RawFd>>,
    pub no_slot_seen: RefCell<Vec<u32>>,
}

impl Pool {
    pub fn new(backends: usize, pool_max: u32) -> Pool {
        let slots = backends * pool_max as usize;
        Pool {
            wake: (0..slots).map(|_| Notify::new()).collect(),
            fds: RefCell::new(vec![-1; slots]),
            no_slot_seen: RefCell::new(vec![0; backends]),
        }
    }

    pub fn wake(&self, slot: u32) {
        if let Some(n) = self.wake.get(slot as usize) {
            n.notify_one();
        }
    }
}
