//! Flow moves (lb.toml `[moves]`): the host a connection goes to asks, in
//! one authenticated UDP datagram (`inband_core::flow_move`), that the
//! connection's next packets go to another backend of the same VIP; this
//! worker checks the request against the maps, rewrites the flow and
//! answers. The asker is an `inband proxy` that froze the client's TCP
//! connection and had another server rebuild it (docs/tcpe.md).
//!
//! Checks, in order; the first three are dropped unanswered (an answer
//! would let anyone aim our replies at an address), every later refusal
//! is answered with its `MoveOutcome`, and each is counted (`control_stats`,
//! `move_*`):
//!
//! 1. not a request, or a signed field no sender writes (`move_malformed`);
//!    no key of its id or a MAC that does not verify (`move_bad_mac`);
//! 2. sent from another address than the `from` it names
//!    (`move_unknown_sender`): only the flow's backend may move it, and
//!    the MAC alone says only that a key holder wrote it;
//! 3. a sequence number not above the last this sender's address used
//!    (`Refused`, `move_replayed`), so a recorded request is worthless;
//!    every request past this point uses up its number, whatever its
//!    outcome, so a refused one cannot succeed later either;
//! 4. no established flow of that client side (`NoFlow`);
//! 5. the flow does not go to `from` (`NotOwner`);
//! 6. `to` is not a backend of the flow's VIP, removed, or DOWN
//!    (`NotABackend`); a DRAINING one is taken, which is what a weight of 0
//!    writes: servers listed so take no new connections, only moved ones;
//! 7. a fleet tuple (`Refused`, `move_refused`): the fleet's other
//!    instances, which may carry the connection, would not know of the move;
//! 8. another live flow or handshake holds the flow's SNAT port toward `to`
//!    and none of `PORT_TRIES` other ports is free there (`PortInUse`).
//!
//! A flow that goes to `to` already (a retry after a lost answer) is
//! answered `Moved` with its port, and nothing changes. Otherwise the
//! port is reserved toward `to` (inserted only if absent, as the data path
//! takes a port): the flow's own if it is free there, else another, which
//! the answer names (the server rebuilds the connection from it); then the
//! flow rewritten in place of the one read (only if still there), the old
//! reservation deleted, and the move counted in the load estimate
//! (bpf/include/inband/lb/moves.h says why that takes a program). Ports
//! collide more as moves grow: every moved connection holds its port
//! toward `to` until its flow ends, and new connections choose theirs
//! toward the proxy, not knowing where they will go.
//!
//! The senders' last sequence numbers are kept per address, for at most
//! MAX_BACKENDS addresses (a sender must be a backend to get anything
//! done). When that many are known, a new address is refused (`Refused`,
//! `move_refused`) rather than one forgotten: forgetting a sender would
//! make its recorded requests good again. The table lives as long as the
//! daemon. A restarted one starts every sender at its own start time (the
//! senders draw their numbers from their wall clocks, in µs): a request
//! recorded before the restart is refused as replayed, and a sender whose
//! clock is behind the balancer's has its moves refused (and proxied)
//! until its clock passes that time.

use std::collections::hash_map::{Entry, HashMap};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use libbpf_rs::{libbpf_sys, ErrorKind, MapCore, MapFlags};
use tracing::{info, warn};

use super::config::LbConfig;
use super::maps::*;
use super::polling;
use super::tables::{self, LbMaps};
use inband_core::bpfmap;
use inband_core::flow_move::{self, MoveOutcome, MoveRefusal, MoveRequest};
use inband_core::pod::{be_ip, be_port, ip_of, port_of, Pod};
use inband_core::wire::Key;

/// How long the worker waits for a datagram: the bound on noticing `stop`.
const WAIT: Duration = Duration::from_millis(100);
const PROBE_FLAGS: u8 = FLOW_PROBE_OUTSTANDING | inband_core::shared::INBAND_FLOW_PROBE_OLD as u8;

/// The last sequence number taken from each sender address.
pub struct Senders {
    last: HashMap<IpAddr, u64>,
    max: usize,
    /// Numbers up to this are refused from every sender: what a sender
    /// used before the table existed.
    floor: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqRefused {
    Replayed,
    Full,
}

impl Senders {
    /// `floor`: numbers up to it are refused (the wall clock in µs at the
    /// daemon's start).
    pub fn new(max: usize, floor: u64) -> Senders {
        Senders { last: HashMap::new(), max, floor }
    }

    /// Takes `seq` from `sender` if it is above that sender's last.
    pub fn take(&mut self, sender: IpAddr, seq: u64) -> Result<(), SeqRefused> {
        if seq <= self.floor {
            return Err(SeqRefused::Replayed);
        }
        let full = self.last.len() >= self.max;
        match self.last.entry(sender) {
            Entry::Occupied(last) if seq <= *last.get() => Err(SeqRefused::Replayed),
            Entry::Occupied(mut last) => {
                last.insert(seq);
                Ok(())
            }
            Entry::Vacant(_) if full => Err(SeqRefused::Full),
            Entry::Vacant(v) => {
                v.insert(seq);
                Ok(())
            }
        }
    }
}

/// What a request came to: its outcome on the wire, told apart as the
/// counters tell them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveAnswer {
    Moved,
    NoFlow,
    NotOwner,
    NotABackend,
    PortInUse,
    Replayed,
    Fleet,
    SendersFull,
}

impl MoveAnswer {
    pub fn outcome(self) -> MoveOutcome {
        match self {
            MoveAnswer::Moved => MoveOutcome::Moved,
            MoveAnswer::NoFlow => MoveOutcome::NoFlow,
            MoveAnswer::NotOwner => MoveOutcome::NotOwner,
            MoveAnswer::NotABackend => MoveOutcome::NotABackend,
            MoveAnswer::PortInUse => MoveOutcome::PortInUse,
            MoveAnswer::Replayed | MoveAnswer::Fleet | MoveAnswer::SendersFull => MoveOutcome::Refused,
        }
    }

    fn count(self, s: &mut ControlStats) {
        *match self {
            MoveAnswer::Moved => &mut s.moves,
            MoveAnswer::NoFlow => &mut s.move_no_flow,
            MoveAnswer::NotOwner => &mut s.move_not_owner,
            MoveAnswer::NotABackend => &mut s.move_not_a_backend,
            MoveAnswer::PortInUse => &mut s.move_port_in_use,
            MoveAnswer::Replayed => &mut s.move_replayed,
            MoveAnswer::Fleet | MoveAnswer::SendersFull => &mut s.move_refused,
        } += 1;
    }
}

/// What the checks against the flow and its VIP allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judged {
    /// Move it to the backend of this id.
    Move(u32),
    /// It goes to `to` already (the sender's earlier request was taken):
    /// answered as moved, nothing changed.
    There,
}

/// What the checks against the flow and its VIP find, or the refusal.
/// `slots`: the flow's VIP's (backend id, backend) in slot order.
pub fn judge(req: &MoveRequest, flow: Option<&Flow>, slots: &[(u32, Backend)]) -> Result<Judged, MoveAnswer> {
    let f = flow.filter(|f| f.state == FLOW_ESTABLISHED).ok_or(MoveAnswer::NoFlow)?;
    let now = SocketAddr::new(ip_of(&f.backend_addr), port_of(f.backend_port));
    if now == req.to && req.from != req.to {
        return Ok(Judged::There);
    }
    if now != req.from {
        return Err(MoveAnswer::NotOwner);
    }
    let (id, _) = slots
        .iter()
        .find(|(_, b)| tables::backend_endpoint(b) == req.to && !backend_removed(b) && b.flags & BACKEND_DOWN == 0)
        .ok_or(MoveAnswer::NotABackend)?;
    if f.snat_index == SNAT_FLEET {
        return Err(MoveAnswer::Fleet);
    }
    Ok(Judged::Move(*id))
}

/// The client side as the maps key it.
pub fn flow_key(req: &MoveRequest) -> FlowKey {
    FlowKey {
        client_addr: be_ip(req.flow.client.ip()),
        vip_addr: be_ip(req.flow.vip.ip()),
        client_port: be_port(req.flow.client.port()),
        vip_port: be_port(req.flow.vip.port()),
        proto: req.flow.proto,
        pad: [0; 3],
    }
}

/// The server side of `f`, as lifecycle.h's nat_key_of.
fn nat_key_of(f: &Flow) -> NatKey {
    NatKey {
        backend_addr: f.backend_addr,
        backend_port: f.backend_port,
        snat_port: f.snat_port,
        proto: f.proto,
        snat_index: f.snat_index,
        fleet_suffix: f.fleet_suffix,
        ..Default::default()
    }
}

fn uses(f: &Flow, nk: &NatKey) -> bool {
    nat_key_of(f).as_bytes() == nk.as_bytes()
}

/// The key a request names (`id`), to check it and sign its answer: the
/// data path's own (`auth_keys` as last written), so a reload's new
/// `[auth]` applies to the next request.
fn keys(maps: &LbMaps, id: u8) -> Result<Vec<(u8, Key)>> {
    let cfg: DataPathConfig = bpfmap::get(&maps.lb_config, &0u32)?.unwrap_or_default();
    Ok(inband_core::auth::read_key_by_id(cfg.auth_mode, &maps.auth_keys, id)?.unwrap_or_default())
}

/// The handler of the requests, with the senders' sequence numbers and the
/// program that carries a moved flow's count in the load estimate.
pub struct Moves<'p> {
    senders: Senders,
    counts: BorrowedFd<'p>,
}

impl<'p> Moves<'p> {
    /// `counts`: the balancer object's `move_counts` program.
    pub fn new(counts: BorrowedFd<'p>) -> Moves<'p> {
        let now_us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        Moves { senders: Senders::new(MAX_BACKENDS as usize, now_us), counts }
    }

    /// One datagram `d` from `src`: the reply to send back to `src`, if
    /// any, with what it came to counted in `stats`. The caller holds the
    /// daemon's config lock, so that no reload rewrites the VIP's tables
    /// between the checks and the move.
    pub fn handle(&mut self, maps: &LbMaps, src: SocketAddr, d: &[u8], stats: &mut ControlStats) -> Result<Option<Vec<u8>>> {
        // No request at all: the decoder refuses it without a key.
        let keys = match flow_move::request_key_id(d) {
            Some(id) => keys(maps, id)?,
            None => Vec::new(),
        };
        let req = match flow_move::decode_request(d, &keys) {
            Ok(r) => r,
            Err(MoveRefusal::NotOurs | MoveRefusal::Malformed) => {
                stats.move_malformed += 1;
                return Ok(None);
            }
            Err(MoveRefusal::BadMac) => {
                stats.move_bad_mac += 1;
                return Ok(None);
            }
        };
        if src.ip().to_canonical() != req.from.ip() {
            stats.move_unknown_sender += 1;
            return Ok(None);
        }
        let (answer, port) = match self.senders.take(req.from.ip(), req.seq) {
            Err(SeqRefused::Replayed) => (MoveAnswer::Replayed, 0),
            Err(SeqRefused::Full) => (MoveAnswer::SendersFull, 0),
            Ok(()) => self.apply(maps, &req)?,
        };
        answer.count(stats);
        Ok(flow_move::encode_reply(&req, answer.outcome(), port, &keys))
    }

    /// Checks the flow and `to`, then moves the flow; with `Moved`, its
    /// source port toward `to` (host order).
    fn apply(&self, maps: &LbMaps, req: &MoveRequest) -> Result<(MoveAnswer, u16)> {
        let key = flow_key(req);
        let flow: Option<Flow> = bpfmap::get(&maps.flows, &key)?;
        let slots = match &flow {
            Some(f) => vip_slots(maps, u32::from(f.vip_id))?,
            None => Vec::new(),
        };
        let (to_id, old) = match (judge(req, flow.as_ref(), &slots), flow) {
            (Err(a), _) => return Ok((a, 0)),
            (Ok(Judged::There), Some(f)) => return Ok((MoveAnswer::Moved, port_of(f.snat_port))),
            (Ok(Judged::Move(to_id)), Some(f)) => (to_id, f),
            (Ok(_), None) => unreachable!("judge found a flow"),
        };
        let mut moved = Flow {
            backend_addr: be_ip(req.to.ip()),
            backend_port: be_port(req.to.port()),
            backend_id: to_id as u16,
            // A 124 outstanding went to the old backend, whose answer no
            // longer comes through this flow: the next packet may ask anew.
            flags: old.flags & !PROBE_FLAGS,
            ..old
        };
        let Some(nk) = reserve_some_port(maps, &mut moved, &key)? else {
            return Ok((MoveAnswer::PortInUse, 0));
        };
        // Only in place of an entry: one the data path or the sweeper ended
        // meanwhile stays ended. A packet of the flow between the read and
        // this write may have set `seen` or the client's sequence record:
        // the write takes them back to what was read, which costs at most
        // an early idle expiry or a window a step behind.
        match maps.flows.update(key.as_bytes(), moved.as_bytes(), MapFlags::EXIST) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {
                bpfmap::delete(&maps.snat, &nk)?;
                return Ok((MoveAnswer::NoFlow, 0));
            }
            Err(e) => return Err(e).context("rewriting the moved flow"),
        }
        let old_nk = nat_key_of(&old);
        let owner: Option<SnatOwner> = bpfmap::get(&maps.snat, &old_nk)?;
        if owner.is_some_and(|o| o.flow.as_bytes() == key.as_bytes()) {
            bpfmap::delete(&maps.snat, &old_nk)?;
        }
        run_counts(self.counts, old.backend_id, to_id as u16, old.mode, old.flags)?;
        Ok((MoveAnswer::Moved, port_of(moved.snat_port)))
    }
}

/// Other ports tried toward `to` when the flow's own is held there: with
/// half the range held toward one backend, a move still finds one in all
/// but 2^-32 of the cases.
const PORT_TRIES: u32 = 32;

/// Reserves toward `moved`'s backend its SNAT port, or, when that is held
/// there, one of `PORT_TRIES` others drawn from the SNAT range, which
/// `moved` then takes; the reserved key, or None.
fn reserve_some_port(maps: &LbMaps, moved: &mut Flow, key: &FlowKey) -> Result<Option<NatKey>> {
    let nk = nat_key_of(moved);
    if reserve(maps, &nk, key)? {
        return Ok(Some(nk));
    }
    let (min, range) = (inband_core::shared::INBAND_SNAT_PORT_MIN, SNAT_PORTS);
    let start: u32 = rand::random::<u32>() % range;
    // An odd stride: the range is 2^10 x 31, so the walk comes back to its
    // start after 1,024 ports at the soonest, and the tries are distinct.
    let stride = (rand::random::<u32>() % range) | 1;
    for i in 0..PORT_TRIES {
        let port = (min + (start + i * stride) % range) as u16;
        let candidate = Flow { snat_port: be_port(port), ..*moved };
        let nk = nat_key_of(&candidate);
        if reserve(maps, &nk, key)? {
            *moved = candidate;
            return Ok(Some(nk));
        }
    }
    Ok(None)
}

/// The (backend id, backend) of VIP `vid`'s slots.
fn vip_slots(maps: &LbMaps, vid: u32) -> Result<Vec<(u32, Backend)>> {
    let vip: Vip = bpfmap::get(&maps.vip_conf, &vid)?.unwrap_or_default();
    let ids: VipSlots = bpfmap::get(&maps.vip_backends, &vid)?.unwrap_or_default();
    let mut out = Vec::new();
    for id in ids.backend.iter().take(usize::from(vip.backend_count)).map(|b| u32::from(*b)) {
        out.push((id, bpfmap::get(&maps.backends, &id)?.unwrap_or_default()));
    }
    Ok(out)
}

/// Reserves the server side `nk` for the flow `key`, as a port search
/// would: not over a live flow's reservation or a live handshake's hold
/// (whose promotion would overwrite the reservation), and taking over an
/// orphaned reservation. Returns whether it did.
fn reserve(maps: &LbMaps, nk: &NatKey, key: &FlowKey) -> Result<bool> {
    if let Some(h) = bpfmap::get::<NatKey, PortHold>(&maps.half_open_ports, nk)? {
        if bpfmap::get::<FlowKey, Flow>(&maps.half_open, &h.flow)?.is_some_and(|f| uses(&f, nk)) {
            return Ok(false);
        }
    }
    let mine = SnatOwner { flow: *key };
    for _ in 0..2 {
        match maps.snat.update(nk.as_bytes(), mine.as_bytes(), MapFlags::NO_EXIST) {
            Ok(()) => return Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).context("reserving the SNAT port toward the new backend"),
        }
        let Some(o) = bpfmap::get::<NatKey, SnatOwner>(&maps.snat, nk)? else { continue };
        if bpfmap::get::<FlowKey, Flow>(&maps.flows, &o.flow)?.is_some_and(|f| uses(&f, nk)) {
            return Ok(false);
        }
        // An orphan (its flow ended or moved on): free for the taking, as
        // the data path's port search takes it.
        bpfmap::delete(&maps.snat, nk)?;
    }
    Ok(false)
}

/// Runs `move_counts` (bpf/include/inband/lb/moves.h) for a flow of `mode`
/// and `flags` moved from backend `from` to `to`.
fn run_counts(prog: BorrowedFd<'_>, from: u16, to: u16, mode: u8, flags: u8) -> Result<()> {
    let args = MoveCountsArgs { from_id: from, to_id: to, mode, flags, ..Default::default() };
    let bytes = args.as_bytes();
    let mut opts = libbpf_sys::bpf_test_run_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _,
        ctx_in: bytes.as_ptr().cast(),
        ctx_size_in: bytes.len() as u32,
        ..Default::default()
    };
    // SAFETY: ctx_in points to `args`, alive for the call, of the stated size.
    let rc = unsafe { libbpf_sys::bpf_prog_test_run_opts(prog.as_raw_fd(), &mut opts) };
    if rc != 0 {
        bail!("running move_counts (BPF_PROG_RUN): {}", std::io::Error::from_raw_os_error(-rc));
    }
    Ok(())
}

/// Runs until `stop`: answers the requests that come to `[moves] listen`.
/// Only with `[moves]` set (the daemon starts it then).
pub fn run(maps: &LbMaps, counts: BorrowedFd<'_>, cfg: &Arc<Mutex<LbConfig>>, stop: &AtomicBool) -> Result<()> {
    let listen = cfg.lock().unwrap().moves.as_ref().context("[moves] is not set")?.listen.clone();
    let sockets = listen
        .iter()
        .map(|a| UdpSocket::bind(a).with_context(|| format!("binding {a} ([moves] listen)")))
        .collect::<Result<Vec<_>>>()?;
    for s in &sockets {
        s.set_nonblocking(true)?;
    }
    info!(?listen, "taking flow moves");
    let mut moves = Moves::new(counts);
    let mut buf = [0u8; flow_move::MAX_LEN];
    let mut fds: Vec<libc::pollfd> = sockets.iter().map(|s| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: poll(2) on the live descriptors `fds` holds, of its length.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, WAIT.as_millis() as libc::c_int) } <= 0 {
            continue;
        }
        for (socket, fd) in sockets.iter().zip(&fds) {
            if fd.revents == 0 {
                continue;
            }
            loop {
                let (n, src) = match socket.recv_from(&mut buf) {
                    Ok(r) => r,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        warn!(error = %e, "receiving a flow move");
                        break;
                    }
                };
                answer(maps, &mut moves, cfg, socket, src, &buf[..n])?;
            }
        }
    }
    Ok(())
}

/// Handles one datagram under the config lock and sends its answer.
fn answer(maps: &LbMaps, moves: &mut Moves<'_>, cfg: &Arc<Mutex<LbConfig>>, socket: &UdpSocket, src: SocketAddr, d: &[u8]) -> Result<()> {
    let mut stats = ControlStats::default();
    let handled = {
        let _one_writer = cfg.lock().unwrap();
        moves.handle(maps, src, d, &mut stats)
    };
    // A map that fails one request (a full `snat`) fails that request
    // only: its sender hears nothing and may ask again.
    let reply = handled.unwrap_or_else(|e| {
        warn!(error = %format!("{e:#}"), %src, "a flow move failed");
        None
    });
    if let Some(r) = reply {
        if let Err(e) = socket.send_to(&r, src) {
            warn!(error = %e, %src, "answering a flow move");
        }
    }
    polling::add_control_stats(maps, &stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inband_core::flow_move::FlowSide;

    fn request() -> MoveRequest {
        MoveRequest {
            key_id: 1,
            seq: 10,
            flow: FlowSide { client: "192.168.1.1:40001".parse().unwrap(), vip: "10.0.0.100:80".parse().unwrap(), proto: 6 },
            from: "10.0.1.1:8080".parse().unwrap(),
            to: "10.0.1.2:8081".parse().unwrap(),
        }
    }

    fn backend(ep: &str, flags: u16) -> Backend {
        let ep: SocketAddr = ep.parse().unwrap();
        Backend { addr: be_ip(ep.ip()), port: be_port(ep.port()), flags, ..Default::default() }
    }

    fn flow(backend: &str, state: u32) -> Flow {
        let ep: SocketAddr = backend.parse().unwrap();
        Flow { backend_addr: be_ip(ep.ip()), backend_port: be_port(ep.port()), state, proto: 6, snat_port: be_port(2000), ..Default::default() }
    }

    fn slots(to_flags: u16) -> Vec<(u32, Backend)> {
        vec![(10, backend("10.0.1.1:8080", BACKEND_ACTIVE)), (11, backend("10.0.1.2:8081", to_flags))]
    }

    #[test]
    fn only_the_owner_moves_an_established_flow_to_an_up_backend_of_its_vip() {
        let r = request();
        let est = flow("10.0.1.1:8080", FLOW_ESTABLISHED);
        assert_eq!(judge(&r, Some(&est), &slots(BACKEND_ACTIVE)), Ok(Judged::Move(11)));
        // Weight 0 is written DRAINING: such a server takes moved flows.
        assert_eq!(judge(&r, Some(&est), &slots(BACKEND_DRAINING)), Ok(Judged::Move(11)));
        // Moved already (a retry after a lost answer): answered, not moved again.
        assert_eq!(judge(&r, Some(&flow("10.0.1.2:8081", FLOW_ESTABLISHED)), &slots(BACKEND_ACTIVE)), Ok(Judged::There));
        assert_eq!(judge(&r, None, &slots(BACKEND_ACTIVE)), Err(MoveAnswer::NoFlow));
        for state in [FLOW_SYN_SENT, FLOW_CLOSING] {
            assert_eq!(judge(&r, Some(&flow("10.0.1.1:8080", state)), &slots(BACKEND_ACTIVE)), Err(MoveAnswer::NoFlow));
        }
        // The right address on another port is another backend.
        assert_eq!(judge(&r, Some(&flow("10.0.1.1:8081", FLOW_ESTABLISHED)), &slots(BACKEND_ACTIVE)), Err(MoveAnswer::NotOwner));
        assert_eq!(judge(&r, Some(&est), &slots(BACKEND_ACTIVE | BACKEND_DOWN)), Err(MoveAnswer::NotABackend));
        assert_eq!(judge(&r, Some(&est), &slots(0)), Err(MoveAnswer::NotABackend), "a removed backend's tombstone");
        let elsewhere = MoveRequest { to: "10.0.1.2:8080".parse().unwrap(), ..r };
        assert_eq!(judge(&elsewhere, Some(&est), &slots(BACKEND_ACTIVE)), Err(MoveAnswer::NotABackend));
        let fleet = Flow { snat_index: SNAT_FLEET, ..est };
        assert_eq!(judge(&r, Some(&fleet), &slots(BACKEND_ACTIVE)), Err(MoveAnswer::Fleet));
        assert_eq!(MoveAnswer::Fleet.outcome(), MoveOutcome::Refused);
    }

    #[test]
    fn a_sender_takes_only_rising_numbers_and_a_full_table_takes_no_new_sender() {
        let a: IpAddr = "10.0.1.1".parse().unwrap();
        let b: IpAddr = "10.0.1.2".parse().unwrap();
        let mut s = Senders::new(1, 2);
        assert_eq!(s.take(a, 5), Ok(()));
        assert_eq!(s.take(a, 5), Err(SeqRefused::Replayed));
        assert_eq!(s.take(a, 4), Err(SeqRefused::Replayed));
        assert_eq!(s.take(b, 9), Err(SeqRefused::Full));
        assert_eq!(s.take(a, 6), Ok(()));
        let mut two = Senders::new(2, 2);
        assert_eq!((two.take(a, 5), two.take(b, 3)), (Ok(()), Ok(())), "each sender's numbers are its own");
        // Numbers from before the table (a restart) are refused from anyone.
        let mut fresh = Senders::new(2, 100);
        assert_eq!((fresh.take(a, 100), fresh.take(b, 7)), (Err(SeqRefused::Replayed), Err(SeqRefused::Replayed)));
        assert_eq!(fresh.take(a, 101), Ok(()));
    }

    #[test]
    fn the_flow_key_holds_addresses_as_the_maps_do() {
        let k = flow_key(&request());
        assert_eq!(ip_of(&k.client_addr), "192.168.1.1".parse::<IpAddr>().unwrap());
        assert_eq!((port_of(k.client_port), port_of(k.vip_port), k.proto), (40001, 80, 6));
        assert_eq!(k.as_bytes()[..16], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 1, 1]);
    }
}
