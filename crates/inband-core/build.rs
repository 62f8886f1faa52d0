/// The headers whose types and constants the control plane shares.
const SHARED_HEADERS: &[&str] = &[
    "addr.h", "quic.h", "wire.h", "auth.h", "lb/consts.h", "lb/types.h", "agent/consts.h", "agent/types.h", "shadow/types.h",
    "mesh/consts.h", "mesh/types.h",
];

fn main() {
    inband_bpf_build::shared_types(SHARED_HEADERS);
}
