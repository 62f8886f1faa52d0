//! The per-packet benchmark measures the paths it names: every row has the
//! verdict of that path, a positive time, and its ratio to the floor; the
//! flood, churn and sweep runs account for every connection they push.

#[test]
fn every_path_runs_with_its_verdict_and_a_ratio_to_the_floor() {
    let rows = inband::bench::dataplane::measure(200).expect("measure");
    let verdicts: Vec<(&str, &str, &str)> = rows.iter().map(|r| (r.path, r.mode, r.verdict)).collect();
    assert_eq!(rows.len(), 12, "{verdicts:?}");
    let floor = rows.last().unwrap();
    assert!(floor.path.starts_with("floor"));
    assert_eq!(floor.ratio_to_floor, 1.0);
    for r in &rows {
        assert!(r.ns_per_packet > 0.0, "{}: {}", r.path, r.ns_per_packet);
        assert!((r.ratio_to_floor - r.ns_per_packet / floor.ns_per_packet).abs() < 1e-9);
        let want = if r.path.starts_with("not for a VIP") { "XDP_PASS" } else { "XDP_TX" };
        assert_eq!(r.verdict, want, "{} ({})", r.path, r.mode);
    }
    let table = inband::bench::dataplane::render(&rows);
    assert_eq!(table.lines().count(), 2 + rows.len());
    assert!(table.contains("| established (client -> backend) | dsr-dynamic | XDP_TX |"));
    assert!(table.contains("| score return (125: checksums, MAC, record, strip) | dsr-dynamic | XDP_TX |"));
}

#[test]
fn a_flood_keeps_the_newest_handshakes_and_refuses_none() {
    // The case: 200,000 SYNs, three times the ports two backends
    // have. Every one is forwarded, taking over the ports of older
    // unfinished handshakes; the oldest are gone, the newest kept.
    let s = inband::bench::dataplane::table_scale(200_000, 2).expect("flood");
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
    let c = inband::bench::dataplane::churn(130_000, 2).expect("churn");
    assert_eq!(c.refused, 0, "{c:?}");
    assert!(c.drops_by_reason.is_empty(), "{c:?}");
    assert!(c.closing_ports_reused > 0, "ports of closed connections were reused: {c:?}");
}

#[test]
fn a_sweep_visits_every_flow() {
    let s = inband::bench::dataplane::sweep_cost(10_000).expect("sweep");
    assert!(s.sweep_ms > 0.0 && s.ns_per_flow > 0.0, "{s:?}");
}
