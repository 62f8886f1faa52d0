//! Built-in phase sets (`--phases`, docs/trace.md "Built-in phase sets"):
//! markers on the probe points of our own binary (`probe_points!` in
//! inband-cache), each called once per event of its phase.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Set {
    pub name: &'static str,
    /// The program the set is for, for the message when a marker is missing.
    pub program: &'static str,
    /// (phase name, function), as `--phase NAME=SYMBOL`.
    pub markers: &'static [(&'static str, &'static str)],
}

pub const SETS: [Set; 2] = [
    Set {
        name: "proxy",
        program: "inband proxy",
        markers: &[
            ("request_in", "inband_proxy::probe::request_in"),
            ("cache_lookup", "inband_proxy::probe::cache_lookup"),
            ("origin_fetch", "inband_proxy::probe::origin_fetch"),
            ("response_out", "inband_proxy::probe::response_out"),
        ],
    },
    Set {
        name: "cache",
        program: "a program using inband-cache (inband proxy, inband bench cache)",
        markers: &[
            ("store_get", "inband_cache::probe::store_get"),
            ("store_put", "inband_cache::probe::store_put"),
            ("store_delete", "inband_cache::probe::store_delete"),
        ],
    },
];

pub fn parse(name: &str) -> Result<Set, String> {
    SETS.iter().copied().find(|s| s.name == name).ok_or_else(|| {
        let names: Vec<&str> = SETS.iter().map(|s| s.name).collect();
        format!("no phase set {name:?} (there are: {})", names.join(", "))
    })
}
