//! Per-client limits, as nginx's `limit_conn`/`limit_req` and HAProxy's
//! stick tables give: how many connections one client may hold open, and
//! how many requests a second it may send. Without them one address that
//! opens connections and sends nothing holds every connection slot until
//! the header timeout, and reopening keeps the service down.
//!
//! A client is an IPv4 address or an IPv6 /64: a host is given a whole /64,
//! and counting its addresses would let it be as many clients as it likes.
//! An entry lives while its client has a connection open, then until its
//! request bucket has refilled, so closing and reopening does not reset a
//! rate. The table holds at most `MAX_CLIENTS`: a client that finds it full
//! of entries still in use is served without limits and counted, so a flood
//! of addresses cannot lock out the clients the limits have never seen.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;

const MAX_CLIENTS: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum ClientKey {
    V4(u32),
    /// The /64 prefix.
    V6(u64),
}

fn key(ip: IpAddr) -> ClientKey {
    match ip.to_canonical() {
        IpAddr::V4(a) => ClientKey::V4(u32::from(a)),
        IpAddr::V6(a) => ClientKey::V6((u128::from(a) >> 64) as u64),
    }
}

struct Entry {
    open: u32,
    tokens: f64,
    refilled: Instant,
}

/// Why a client was not let in.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Connections,
}

pub struct ClientLimits {
    /// 0: no limit.
    max_connections: u32,
    /// Requests a second; 0: no limit.
    rate: f64,
    burst: f64,
    table: Mutex<HashMap<ClientKey, Entry>>,
    /// Clients served without limits because the table was full.
    untracked: Counter,
    /// [`ClientLimits::take`]'s table has no connections closing to forget
    /// clients by: at this many entries it drops those whose bucket has
    /// refilled, then waits for twice as many as remain.
    next_sweep: std::sync::atomic::AtomicUsize,
}

const FIRST_SWEEP: usize = 1024;

impl ClientLimits {
    pub fn new(max_connections: u32, rate: f64, burst: f64, untracked: Counter) -> ClientLimits {
        ClientLimits {
            max_connections,
            rate,
            burst: burst.max(1.0),
            table: Mutex::default(),
            untracked,
            next_sweep: std::sync::atomic::AtomicUsize::new(FIRST_SWEEP),
        }
    }

    /// A new connection of `ip`'s, or why not.
    pub fn open(self: &Arc<Self>, ip: IpAddr) -> Result<ClientSlot, Refused> {
        if self.max_connections == 0 && self.rate == 0.0 {
            return Ok(ClientSlot { limits: self.clone(), key: None });
        }
        let k = key(ip);
        let now = Instant::now();
        let mut t = self.table.lock().unwrap();
        if t.len() >= MAX_CLIENTS && !t.contains_key(&k) {
            let (rate, burst) = (self.rate, self.burst);
            t.retain(|_, e| e.open > 0 || refill(e, now, rate, burst) < burst);
            if t.len() >= MAX_CLIENTS {
                self.untracked.inc();
                return Ok(ClientSlot { limits: self.clone(), key: None });
            }
        }
        let e = t.entry(k).or_insert(Entry { open: 0, tokens: self.burst, refilled: now });
        if self.max_connections != 0 && e.open >= self.max_connections {
            return Err(Refused::Connections);
        }
        e.open += 1;
        Ok(ClientSlot { limits: self.clone(), key: Some(k) })
    }
}

impl ClientLimits {
    /// One request of `ip`'s against the rate alone, for a route's
    /// `rate_limit` (a table of its own, no connections counted): Ok, or
    /// how long until the client's next request would be allowed.
    pub fn take(&self, ip: IpAddr) -> Result<(), std::time::Duration> {
        let k = key(ip);
        let now = Instant::now();
        let (rate, burst) = (self.rate, self.burst);
        let mut t = self.table.lock().unwrap();
        let sweep = &self.next_sweep;
        if t.len() >= sweep.load(Ordering::Relaxed) && !t.contains_key(&k) {
            t.retain(|_, e| e.open > 0 || refill(e, now, rate, burst) < burst);
            sweep.store((2 * t.len()).clamp(FIRST_SWEEP, MAX_CLIENTS), Ordering::Relaxed);
            if t.len() >= MAX_CLIENTS {
                self.untracked.inc();
                return Ok(());
            }
        }
        let e = t.entry(k).or_insert(Entry { open: 0, tokens: burst, refilled: now });
        let tokens = refill(e, now, rate, burst);
        if tokens < 1.0 {
            return Err(std::time::Duration::from_secs_f64((1.0 - tokens) / rate));
        }
        e.tokens -= 1.0;
        Ok(())
    }
}

/// The tokens `e` holds at `now`, written back.
fn refill(e: &mut Entry, now: Instant, rate: f64, burst: f64) -> f64 {
    e.tokens = (e.tokens + now.duration_since(e.refilled).as_secs_f64() * rate).min(burst);
    e.refilled = now;
    e.tokens
}

/// One open connection of a client: counted until dropped.
pub struct ClientSlot {
    limits: Arc<ClientLimits>,
    /// None: not limited (no limits set, or the table was full).
    key: Option<ClientKey>,
}

impl ClientSlot {
    /// Whether the client may send one more request now (and takes it).
    pub fn request(&self) -> bool {
        let (Some(k), rate) = (self.key, self.limits.rate) else { return true };
        if rate == 0.0 {
            return true;
        }
        let mut t = self.limits.table.lock().unwrap();
        let Some(e) = t.get_mut(&k) else { return true };
        if refill(e, Instant::now(), rate, self.limits.burst) < 1.0 {
            return false;
        }
        e.tokens -= 1.0;
        true
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let Some(k) = self.key else { return };
        let l = &self.limits;
        let mut t = l.table.lock().unwrap();
        if let Some(e) = t.get_mut(&k) {
            e.open -= 1;
            // A full bucket says nothing the next connection would not
            // start with: forget the client.
            if e.open == 0 && (l.rate == 0.0 || refill(e, Instant::now(), l.rate, l.burst) >= l.burst) {
                t.remove(&k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn connections_are_counted_per_ipv4_address_and_per_ipv6_64() {
        let l = Arc::new(ClientLimits::new(2, 0.0, 0.0, Counter::default()));
        let a = [l.open(ip("192.0.2.1")).unwrap(), l.open(ip("192.0.2.1")).unwrap()];
        assert_eq!(l.open(ip("192.0.2.1")).err(), Some(Refused::Connections));
        assert!(l.open(ip("192.0.2.2")).is_ok(), "another address is another client");
        assert!(l.open(ip("::ffff:192.0.2.3")).is_ok());
        let b = [l.open(ip("2001:db8::1")).unwrap(), l.open(ip("2001:db8::ffff:2")).unwrap()];
        assert_eq!(l.open(ip("2001:db8::3")).err(), Some(Refused::Connections), "one /64 is one client");
        assert!(l.open(ip("2001:db8:0:1::1")).is_ok(), "the next /64 is another");
        drop(a);
        assert!(l.open(ip("192.0.2.1")).is_ok(), "a closed connection frees its place");
        drop(b);
        assert!(l.table.lock().unwrap().len() <= 1, "clients without connections are forgotten");
    }

    #[test]
    fn requests_beyond_the_burst_wait_for_the_rate_and_reconnecting_does_not_reset_it() {
        let l = Arc::new(ClientLimits::new(0, 1.0, 3.0, Counter::default()));
        let s = l.open(ip("192.0.2.1")).unwrap();
        assert_eq!((0..5).map(|_| s.request()).collect::<Vec<_>>(), [true, true, true, false, false]);
        drop(s);
        let s = l.open(ip("192.0.2.1")).unwrap();
        assert!(!s.request(), "the bucket outlives the connection");
        assert!(l.open(ip("192.0.2.9")).unwrap().request(), "another client has its own");
    }

    #[test]
    fn take_limits_requests_alone_and_says_how_long_to_wait() {
        let l = ClientLimits::new(0, 2.0, 2.0, Counter::default());
        assert!(l.take(ip("192.0.2.1")).is_ok() && l.take(ip("192.0.2.1")).is_ok());
        let wait = l.take(ip("192.0.2.1")).unwrap_err();
        assert!(wait > std::time::Duration::from_millis(400) && wait <= std::time::Duration::from_millis(500), "{wait:?}");
        assert!(l.take(ip("192.0.2.2")).is_ok(), "another client has its own bucket");
    }

    #[test]
    fn take_forgets_clients_whose_bucket_refilled() {
        let l = ClientLimits::new(0, 1e9, 1.0, Counter::default());
        for i in 0..10 * FIRST_SWEEP as u32 {
            assert!(l.take(IpAddr::from(std::net::Ipv4Addr::from(i))).is_ok());
        }
        assert!(l.table.lock().unwrap().len() <= FIRST_SWEEP, "{}", l.table.lock().unwrap().len());
    }

    #[test]
    fn no_limits_track_nothing() {
        let l = Arc::new(ClientLimits::new(0, 0.0, 0.0, Counter::default()));
        let s: Vec<_> = (0..100).map(|_| l.open(ip("192.0.2.1")).unwrap()).collect();
        assert!(s.iter().all(ClientSlot::request));
        assert!(l.table.lock().unwrap().is_empty());
    }
}
