//! The per-packet benchmark measures the paths it names: every row has the
//! verdict of that path, a positive time, and its ratio to the floor; the
//! flood, churn and sweep runs account for every connection they push.

/// Every row of the per-packet table, in the order of the run: IPv4
/// (authenticated options, then pass-through), IPv6, UDP with QUIC, the
/// seed format, the floor with a flow lookup, the floor.
const ROWS: [(&str, &str, &str, &str); 24] = [
    ("new connection (SYN: select, SNAT, 155 + MAC)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("handshake done (second packet: half-open -> flows)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("established (client -> backend)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("established + score request (124 + MAC)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("score return (125: checksums, MAC, record, strip)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("established (client -> backend)", "IPv4", "passthrough", "XDP_TX"),
    ("return (backend -> client, NAT back)", "IPv4", "passthrough", "XDP_TX"),
    ("not for a VIP (pass to the kernel)", "any", "any", "XDP_PASS"),
    ("new connection (SYN: select, SNAT, 155 + MAC)", "IPv6", "dsr-dynamic", "XDP_TX"),
    ("handshake done (second packet: half-open -> flows)", "IPv6", "dsr-dynamic", "XDP_TX"),
    ("established (client -> backend)", "IPv6", "dsr-dynamic", "XDP_TX"),
    ("established + score request (124 + MAC)", "IPv6", "dsr-dynamic", "XDP_TX"),
    ("score return (125: checksums, MAC, record, strip)", "IPv6", "dsr-dynamic", "XDP_TX"),
    ("new flow (first datagram: select, SNAT, 155 + stamp + MAC)", "UDP (QUIC)", "dsr-dynamic", "XDP_TX"),
    ("handshake done (second packet: half-open -> flows)", "UDP (QUIC)", "dsr-dynamic", "XDP_TX"),
    ("established (client -> backend)", "UDP (QUIC)", "dsr-dynamic", "XDP_TX"),
    ("established + score request (124 + MAC)", "UDP (QUIC)", "dsr-dynamic", "XDP_TX"),
    ("score return (125: checksums, MAC, record, strip)", "UDP (QUIC)", "dsr-dynamic", "XDP_TX"),
    ("short header, no flow (routed by connection ID)", "UDP (QUIC)", "dsr-dynamic", "XDP_TX"),
    ("new connection (SYN: select, SNAT, seed 155)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("established + score request (seed 124)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("score return (seed 125: checksums, record, strip)", "IPv4", "dsr-dynamic", "XDP_TX"),
    ("floor + the flow's lookup (IPv4 and TCP read, LRU hash of the flow table's type)", "IPv4", "-", "XDP_TX"),
    ("floor: bounce (swap MACs, XDP_TX)", "IPv4", "-", "XDP_TX"),
];

#[test]
fn every_path_runs_with_its_verdict_and_a_ratio_to_the_floor() {
    let rows = inband_testkit::bench::dataplane::measure(200).expect("measure");
    let got: Vec<(&str, &str, &str, &str)> = rows.iter().map(|r| (r.path, r.traffic, r.mode, r.verdict)).collect();
    assert_eq!(got, ROWS);
    let floor = rows.last().unwrap();
    assert_eq!(floor.ratio_to_floor, 1.0);
    for r in &rows {
        assert!(r.ns_per_packet > 0.0, "{}: {}", r.path, r.ns_per_packet);
        assert!((r.ratio_to_floor - r.ns_per_packet / floor.ns_per_packet).abs() < 1e-9);
    }
    let table = inband_testkit::bench::dataplane::render(&rows);
    assert_eq!(table.lines().count(), 2 + rows.len());
    for (path, traffic, mode, verdict) in ROWS {
        assert!(table.contains(&format!("| {path} | {traffic} | {mode} | {verdict} |")), "{path} ({traffic}, {mode})");
    }
}

#[test]
fn a_flood_keeps_the_newest_handshakes_and_refuses_none() {
    // The case: 200,000 SYNs, three times the ports two backends
    // have. Every one is forwarded, taking over the ports of older
    // unfinished handshakes; the oldest are gone, the newest kept.
    let s = inband_testkit::bench::dataplane::table_scale(200_000, 2).expect("flood");
    assert_eq!((s.forwarded, s.dropped), (200_000, 0), "{s:?}");
    assert!(s.drops_by_reason.is_empty());
    assert_eq!(s.established_in_table, 0);
    assert!(s.half_open_ports_preempted >= 200_000 - u64::from(s.snat_ports), "{s:?}");
    assert!(s.newest_1000_kept >= 990, "{s:?}");
    assert!(s.oldest_1000_kept <= 50, "{s:?}");
}

#[test]
fn churn_past_the_port_space_refuses_nothing() {
    // Twice the ports two backends have, each connection opened and closed.
    let c = inband_testkit::bench::dataplane::churn(130_000, 2).expect("churn");
    assert_eq!(c.refused, 0, "{c:?}");
    assert!(c.drops_by_reason.is_empty(), "{c:?}");
    assert!(c.closing_ports_reused > 0, "ports of closed connections were reused: {c:?}");
}

#[test]
fn a_sweep_visits_every_flow() {
    let s = inband_testkit::bench::dataplane::sweep_cost(10_000).expect("sweep");
    assert!(s.sweep_ms > 0.0 && s.ns_per_flow > 0.0, "{s:?}");
}
