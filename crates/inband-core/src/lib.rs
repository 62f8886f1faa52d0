//! What every inband product shares: the wire format and its
//! authentication, the C headers' types (`shared`), typed BPF map access,
//! the balancer's control protocol, the out-of-band score protocol, and
//! the host helpers (netlink, tc, network namespaces, commands). No product
//! crate imports another; they meet here.

pub mod auth;
pub mod bpfmap;
pub mod command;
pub mod flow_move;
pub mod lb_control;
pub mod map_upgrade;
pub mod net;
pub mod netif;
pub mod pod;
pub mod poll_wire;
pub mod prog_stats;
pub mod runlock;
pub mod shared;
pub mod tc;
pub mod wire;
pub mod xdp_live;
