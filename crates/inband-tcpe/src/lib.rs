//! TCPE (seed 003, chapter 6; issue 29): moving a connection from an L7
//! balancer to the server it chose. The options that group a connection's
//! subflows and tell a peer to add a path are one definition in
//! bpf/include/inband/tcpe/wire.h; `wire` builds and parses them,
//! `sockops` loads the program that writes and verifies them on live
//! connections. On top: the client (`client`, its C ABI `ffi`), the join
//! that ties a new subflow to a connection (`join`), the takeover channel
//! between balancer and server (`channel`), the server's takeover
//! (`takeover`) and the balancer's handoff routine (`handoff`). The
//! transparent handoff moves a stock client's connection at L4: `repair`
//! freezes it and rebuilds it elsewhere, `agent_flows` reads and writes
//! the agents' entries for it, `transparent` is the balancer's routine
//! (docs/tcpe.md, "The transparent handoff").
//! docs/architecture.md, "Connection handoff".

pub mod agent_flows;
pub mod bpf;
pub mod channel;
pub mod cli;
pub mod client;
pub mod ffi;
pub mod handoff;
pub mod join;
pub mod relay;
pub mod repair;
pub mod sockops;
pub mod takeover;
pub mod transparent;
pub mod wire;
