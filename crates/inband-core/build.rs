/// The headers whose types and constants the control plane shares.
const SHARED_HEADERS: &[&str] = &["addr.h", "quic.h", "wire.h", "auth.h", "balancer_maps.h", "agent_maps.h", "shadow_maps.h", "mesh_maps.h"];

fn main() {
    inband_bpf_build::shared_types(SHARED_HEADERS);
}
