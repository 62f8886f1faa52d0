//! The namespace testbed itself: what `up` builds and that teardown leaves
//! nothing, also when the test panics.

use inband_testkit::testbed::{Testbed, TestbedSpec};

fn spec(tag: &str) -> TestbedSpec {
    TestbedSpec { name: format!("t{}{tag}", std::process::id() % 100000), clients: 1, servers: 2, subnet: 78, client_link_mtu: None, ecmp: false, balancers: 0, bgp: false, client_addresses: 1 }
}

fn netns_names() -> String {
    String::from_utf8_lossy(&std::process::Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).to_string()
}

#[test]
fn builds_hosts_on_a_bridge_and_tears_down() {
    let s = spec("a");
    let name = s.name.clone();
    let tb = Testbed::up(s).unwrap();
    let listed = netns_names();
    for node in ["sw", "lb", "c1", "s1", "s2"] {
        assert!(listed.contains(&format!("{name}-{node}")), "{node} missing in {listed}");
    }
    assert_eq!(tb.addr("lb").to_string(), "10.78.0.2");
    assert_eq!(tb.addr("s2").to_string(), "10.78.0.22");
    // The client reaches the servers and the VIP (local on the balancer) over the bridge.
    for dst in [tb.addr("s1"), tb.addr("s2"), tb.vip()] {
        let out = tb.exec("c1", &["ping", "-c", "1", "-W", "2", &dst.to_string()]).unwrap();
        assert!(out.status.success(), "ping {dst}: {}", String::from_utf8_lossy(&out.stdout));
    }
    let lo = tb.exec("lb", &["ip", "-4", "addr", "show", "dev", "lo"]).unwrap();
    assert!(String::from_utf8_lossy(&lo.stdout).contains("10.78.0.100/32"));
    // The balancer's bridge port runs the pass program XDP_TX needs.
    let port = std::process::Command::new("ip").args(["-n", &format!("{name}-sw"), "link", "show", "p-lb"]).output().unwrap();
    assert!(String::from_utf8_lossy(&port.stdout).contains("prog/xdp"));
    tb.down().unwrap();
    assert!(!netns_names().contains(&name));
}

#[test]
fn a_panicking_test_still_cleans_up() {
    let s = spec("b");
    let name = s.name.clone();
    let r = std::panic::catch_unwind(|| {
        let mut tb = Testbed::up(s).unwrap();
        tb.spawn("s1", &["sleep", "30"]).unwrap();
        panic!("test failure");
    });
    assert!(r.is_err());
    assert!(!netns_names().contains(&name), "namespaces left after a panic");
}

#[test]
fn refuses_bad_names() {
    for bad in ["", "UPPER", "with-dash", "waytoolongname"] {
        let e = Testbed::up(TestbedSpec { name: bad.into(), ..spec("c") }).unwrap_err();
        assert!(format!("{e:#}").contains("use 1-8 characters"), "{bad}: {e:#}");
    }
}

#[test]
fn an_ecmp_testbed_with_balancers_and_bgp_tears_down_every_namespace_and_daemon() {
    let s = TestbedSpec { ecmp: true, balancers: 2, bgp: true, ..spec("d") };
    let name = s.name.clone();
    let tb = Testbed::up(s).unwrap();
    let listed = netns_names();
    for node in ["r1", "c1", "s1", "s2", "b1", "b2"] {
        assert!(listed.contains(&format!("{name}-{node}")), "{node} missing in {listed}");
    }
    // The balancers' links run the pass program (their XDP_TX), the servers' do not.
    let link = |dev: &str| String::from_utf8_lossy(&tb.exec("r1", &["ip", "link", "show", dev]).unwrap().stdout).to_string();
    assert!(link("b1").contains("prog/xdp") && !link("s1").contains("prog/xdp"));
    let bird = |ns: &str| std::process::Command::new("ip").args(["netns", "pids", ns]).output().unwrap().stdout;
    assert!(!bird(&format!("{name}-b2")).is_empty(), "no BIRD in b2");
    tb.down().unwrap();
    assert!(!netns_names().contains(&name), "namespaces left: {}", netns_names());
    let files: Vec<_> = std::fs::read_dir("/run/inband/testbed").unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&name)).collect();
    assert!(files.is_empty(), "files left: {files:?}");
    // Bad combinations are refused before anything is built.
    let e = Testbed::up(TestbedSpec { bgp: true, ..spec("e") }).unwrap_err();
    assert!(format!("{e:#}").contains("add --balancers N"), "{e:#}");
    let e = Testbed::up(TestbedSpec { balancers: 2, ..spec("e") }).unwrap_err();
    assert!(format!("{e:#}").contains("(--ecmp)"), "{e:#}");
}

/// `client_addresses`: a client answers from each of its extra addresses
/// (IPv4 and IPv6) and every other node reaches them on the bridge; the
/// layouts that route clients refuse it.
#[test]
fn a_client_can_have_several_addresses() {
    let tb = Testbed::up(TestbedSpec { client_addresses: 3, ..spec("m") }).unwrap();
    let (v4, v6) = (tb.client_addrs("c1").unwrap(), tb.client_addrs6("c1").unwrap());
    assert_eq!(v4.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["10.78.0.11", "10.78.129.1", "10.78.129.2"]);
    assert_eq!(v6[2].to_string(), "fd00:78:81::2");
    for (a, a6) in v4.iter().zip(&v6).skip(1) {
        for (from, to) in [(a.to_string(), tb.addr("s1").to_string()), (a6.to_string(), tb.addr6("s2").to_string())] {
            let out = tb.exec("c1", &["ping", "-c", "1", "-W", "2", "-I", &from, &to]).unwrap();
            assert!(out.status.success(), "ping {to} from {from}: {}", String::from_utf8_lossy(&out.stdout));
        }
        // And the other way: a server reaches the extra address itself.
        let out = tb.exec("s1", &["ping", "-c", "1", "-W", "2", &a.to_string()]).unwrap();
        assert!(out.status.success(), "ping {a} from s1: {}", String::from_utf8_lossy(&out.stdout));
    }
    tb.down().unwrap();
    for bad in [TestbedSpec { client_addresses: 2, client_link_mtu: Some(1280), ..spec("n") }, TestbedSpec { client_addresses: 251, ..spec("n") }] {
        let e = format!("{:#}", Testbed::up(bad).unwrap_err());
        assert!(e.contains("addresses per client"), "{e}");
    }
}
