//! `dsr-polling`: the paper's "request busyness" baseline. The daemon asks
//! every backend's agent for its score over UDP at a fixed interval and
//! writes the answers into `scores`. Every request and reply is counted in
//! `control_stats`, so the cost of out-of-band feedback can be compared with
//! in-band feedback's zero extra packets.

use std::collections::HashMap;
use std::net::{SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use tracing::warn;

use super::config::LbConfig;
use super::maps::{BackendScore, ControlStats, Mode};
use super::tables::{self, LbMaps};
use crate::agent::poll_proto;
use crate::bpfmap;

/// Ethernet + IPv4 + UDP headers around each poll datagram.
const WIRE_OVERHEAD: u64 = 14 + 20 + 8;

pub fn run(maps: &LbMaps, cfg: &Arc<Mutex<LbConfig>>, stop: &AtomicBool) -> Result<()> {
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    let mut buf = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        let polled: Vec<(u64, u16, Vec<SocketAddrV4>)> = {
            let c = cfg.lock().unwrap();
            c.vips
                .iter()
                .filter(|v| v.mode == Mode::DsrPolling)
                .map(|v| {
                    (v.poll_interval_ms, v.poll_port, v.backends.iter().map(|b| SocketAddrV4::new(b.address, b.port)).collect())
                })
                .collect()
        };
        if polled.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let interval = Duration::from_millis(polled.iter().map(|p| p.0).min().unwrap_or(100));
        let round = Instant::now();
        // backend endpoint -> ids (one server may back several VIPs)
        let ids = backend_ids(maps)?;
        let mut stats: ControlStats = bpfmap::get(&maps.control_stats, &0u32)?.unwrap_or_default();
        let mut waiting: HashMap<(std::net::Ipv4Addr, u16), usize> = HashMap::new();
        for (_, poll_port, backends) in &polled {
            for be in backends {
                let req = poll_proto::encode_request(be.port());
                match sock.send_to(&req, (*be.ip(), *poll_port)) {
                    Ok(n) => {
                        stats.polls_sent += 1;
                        stats.poll_bytes += n as u64 + WIRE_OVERHEAD;
                        *waiting.entry((*be.ip(), be.port())).or_default() += 1;
                    }
                    Err(e) => {
                        stats.poll_failures += 1;
                        warn!(backend = %be, error = %e, "poll request failed");
                    }
                }
            }
        }
        // Collect replies until the round's time is up.
        while !waiting.is_empty() {
            let left = interval.saturating_sub(round.elapsed());
            if left.is_zero() {
                break;
            }
            sock.set_read_timeout(Some(left))?;
            let Ok((n, from)) = sock.recv_from(&mut buf) else { break };
            let std::net::SocketAddr::V4(from) = from else { continue };
            let Some((port, score)) = poll_proto::decode_reply(&buf[..n]) else { continue };
            if waiting.remove(&(*from.ip(), port)).is_none() {
                continue; // late or unsolicited: not trusted as a fresh score
            }
            stats.poll_replies += 1;
            stats.poll_bytes += n as u64 + WIRE_OVERHEAD;
            let now = tables::ktime_ns();
            for id in ids.get(&SocketAddrV4::new(*from.ip(), port)).into_iter().flatten() {
                bpfmap::put(&maps.scores, id, &BackendScore { score, updated_ns: now, ..Default::default() })?;
            }
        }
        stats.poll_failures += waiting.len() as u64;
        bpfmap::put(&maps.control_stats, &0u32, &stats)?;
        let left = interval.saturating_sub(round.elapsed());
        std::thread::sleep(left);
    }
    Ok(())
}

fn backend_ids(maps: &LbMaps) -> Result<HashMap<SocketAddrV4, Vec<u32>>> {
    let mut out: HashMap<SocketAddrV4, Vec<u32>> = HashMap::new();
    for v in tables::read(maps)? {
        if v.vip.mode == Mode::DsrPolling as u8 {
            for (id, b) in v.slots {
                out.entry(tables::backend_endpoint(&b)).or_default().push(id);
            }
        }
    }
    Ok(out)
}
