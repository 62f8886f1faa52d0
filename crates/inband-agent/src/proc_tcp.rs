//! Reading /proc/net/tcp{,6} to seed `active_conns` with the connections that
//! existed before the tracepoint was attached.

use std::collections::BTreeMap;
use std::net::IpAddr;

use anyhow::{bail, Context, Result};
use inband_core::shared as c;

/// Kernel TCP states as /proc/net/tcp prints them (include/net/tcp_states.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TcpState {
    Established,
    SynSent,
    SynRecv,
    FinWait1,
    FinWait2,
    TimeWait,
    Close,
    CloseWait,
    LastAck,
    Listen,
    Closing,
    NewSynRecv,
}

impl TcpState {
    fn from_code(code: u8) -> Option<TcpState> {
        Some(match code {
            1 => TcpState::Established,
            2 => TcpState::SynSent,
            3 => TcpState::SynRecv,
            4 => TcpState::FinWait1,
            5 => TcpState::FinWait2,
            6 => TcpState::TimeWait,
            7 => TcpState::Close,
            8 => TcpState::CloseWait,
            9 => TcpState::LastAck,
            10 => TcpState::Listen,
            11 => TcpState::Closing,
            12 => TcpState::NewSynRecv,
            _ => return None,
        })
    }

    /// The states the BPF tracepoint counts as active (docs/architecture.md).
    pub fn is_active(self) -> bool {
        matches!(self, TcpState::SynRecv | TcpState::Established | TcpState::FinWait1 | TcpState::FinWait2)
    }
}

/// One line of /proc/net/tcp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpSocket {
    pub local_port: u16,
    /// The remote address (an IPv4 peer of an IPv6 socket as IPv4) and port.
    pub peer: IpAddr,
    pub peer_port: u16,
    pub state: TcpState,
    /// A connection request that has not completed its handshake. The kernel
    /// prints these as SYN_RECV, but they are not sockets yet: no
    /// inet_sock_set_state event ever fires for them (the full socket is
    /// created, and counted, when the handshake completes), so counting them
    /// here would count the connection twice, or forever if it never
    /// completes. They are the only lines with a reference count of 0.
    pub request: bool,
}

/// Parses the text of /proc/net/tcp or /proc/net/tcp6.
pub fn parse(text: &str) -> Result<Vec<TcpSocket>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_line(line).with_context(|| format!("/proc/net/tcp line {}: {line:?}", n + 1))?);
    }
    Ok(out)
}

fn parse_line(line: &str) -> Result<TcpSocket> {
    // sl local rem st tx:rx tr:when retrnsmt uid timeout inode refcnt ...
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 11 {
        bail!("expected at least 11 fields, found {}", f.len());
    }
    let Some((_, port)) = f[1].split_once(':') else { bail!("local address {:?} has no port", f[1]) };
    let Some((remote, rport)) = f[2].split_once(':') else { bail!("remote address {:?} has no port", f[2]) };
    let peer = parse_addr(remote).with_context(|| format!("bad remote address {remote:?}"))?;
    let peer_port = u16::from_str_radix(rport, 16).with_context(|| format!("bad port {rport:?}"))?;
    let local_port = u16::from_str_radix(port, 16).with_context(|| format!("bad port {port:?}"))?;
    let code = u8::from_str_radix(f[3], 16).with_context(|| format!("bad state {:?}", f[3]))?;
    let state = TcpState::from_code(code).with_context(|| format!("unknown state {code}"))?;
    let refcnt: u64 = f[10].parse().with_context(|| format!("bad reference count {:?}", f[10]))?;
    Ok(TcpSocket { local_port, peer, peer_port, state, request: refcnt == 0 && state == TcpState::SynRecv })
}

/// An address as the kernel prints it: 32-bit words in hex, each in the
/// host's byte order (8 digits for IPv4, 32 for IPv6).
fn parse_addr(hex: &str) -> Result<IpAddr> {
    let word = |w: &str| u32::from_str_radix(w, 16).map(u32::to_ne_bytes).map_err(anyhow::Error::from);
    match hex.len() {
        8 => Ok(IpAddr::from(word(hex)?)),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(&hex[i * 8..i * 8 + 8])?);
            }
            Ok(IpAddr::from(b).to_canonical())
        }
        n => bail!("{n} hex digits, expected 8 or 32"),
    }
}

/// Sockets per (local port, state), request sockets excluded.
pub fn count_by_port_state(sockets: &[TcpSocket]) -> BTreeMap<(u16, TcpState), u64> {
    let mut out = BTreeMap::new();
    for s in sockets.iter().filter(|s| !s.request) {
        *out.entry((s.local_port, s.state)).or_insert(0) += 1;
    }
    out
}

/// What the tracepoint would have counted for `port` had it seen every
/// socket from its start: not a balancer's own connections (agent.bpf.c,
/// balancer_own).
pub fn active_on_port(sockets: &[TcpSocket], port: u16, balancers: &[IpAddr]) -> i64 {
    let own = |s: &TcpSocket| u32::from(s.peer_port) > c::INBAND_SNAT_PORT_MAX && balancers.iter().any(|b| b.to_canonical() == s.peer);
    sockets.iter().filter(|s| !s.request && s.local_port == port && s.state.is_active() && !own(s)).count() as i64
}

/// Every TCP socket of this network namespace, both families (an IPv6
/// socket serving an IPv4 client is listed once, in tcp6).
pub fn read() -> Result<Vec<TcpSocket>> {
    // /proc/self/net is this process's network namespace.
    let mut out = parse(&std::fs::read_to_string("/proc/self/net/tcp").context("reading /proc/self/net/tcp")?)?;
    match std::fs::read_to_string("/proc/self/net/tcp6") {
        Ok(text) => out.extend(parse(&text)?),
        // A kernel without IPv6 has no tcp6 and no IPv6 sockets.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).context("reading /proc/self/net/tcp6"),
    }
    Ok(out)
}
