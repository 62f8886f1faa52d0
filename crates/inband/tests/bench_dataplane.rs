//! The per-packet benchmark measures the paths it names: every row has the
//! verdict of that path, a positive time, and its ratio to the floor.

#[test]
fn every_path_runs_with_its_verdict_and_a_ratio_to_the_floor() {
    let rows = inband::bench::dataplane::measure(200).expect("measure");
    let verdicts: Vec<(&str, &str, &str)> = rows.iter().map(|r| (r.path, r.mode, r.verdict)).collect();
    assert_eq!(rows.len(), 8, "{verdicts:?}");
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
}

#[test]
fn flood_accounts_for_every_syn() {
    let s = inband::bench::dataplane::table_scale(3000, 2).expect("flood");
    assert_eq!(s.forwarded + s.dropped, 3000);
    let dropped_by_reason: u64 = s.drops_by_reason.iter().map(|(_, n)| n).sum();
    assert_eq!(dropped_by_reason, u64::from(s.dropped));
    // Far below the table size nothing is evicted: every forwarded SYN has its flow.
    assert_eq!(s.flows_in_table, s.forwarded as usize);
    assert!(s.oldest_1000_kept >= 990 && s.new_conns_per_s_one_core > 0.0, "{s:?}");
}
