//! TCPE, the first layer (seed 003, chapter 6; issue 29): the options that
//! group a connection's subflows and tell a peer to add or remove a path,
//! one definition in bpf/include/inband/tcpe/wire.h; `wire` builds and
//! parses them, `sockops` loads the program that writes and verifies them
//! on live connections. The handoff itself (client library, server
//! takeover, `inband proxy` handing off) stands on this and is not built
//! yet: docs/architecture.md, "TCPE".

pub mod bpf;
pub mod sockops;
pub mod wire;
