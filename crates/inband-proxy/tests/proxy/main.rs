//! Every integration test of `inband proxy`, in one test binary: the proxy
//! crate is built at opt-level 2 (Cargo.toml), so each extra binary would
//! instantiate hyper's generic code optimised once more (about 25 s of
//! compile each on two cores); one binary links it once. Each module is
//! one concern; all run on 127.0.0.1 ephemeral ports, side by side.

mod common;

mod backend_protocols;
mod bad_input;
mod balancing;
mod cache;
mod client_limits;
mod compression;
mod http2;
mod ranges;
mod routes;
mod scores;
mod tcpe;
mod timeouts;
mod tls;
mod upgrade;
mod workers;
