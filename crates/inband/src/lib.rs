//! inband: an eBPF load balancer with Direct Server Return and in-band load
//! feedback. The binary (`src/main.rs`) is a thin CLI over these modules.

pub mod agent;
pub mod auth;
pub mod bench;
pub mod bpf;
pub mod bpfmap;
pub mod command;
pub mod lb;
pub mod mesh;
pub mod net;
pub mod netif;
pub mod packet;
pub mod pod;
pub mod poll_wire;
pub mod runlock;
pub mod shadow;
pub mod tc;
pub mod testbed;
pub mod weights;
pub mod wire;
pub mod workload;
pub mod xdp_live;
