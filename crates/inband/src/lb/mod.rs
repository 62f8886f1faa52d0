//! The balancer's control plane: `inband lb`.

pub mod attach;
pub mod config;
pub mod control;
pub mod daemon;
pub mod maps;
pub mod neighbour;
pub mod polling;
pub mod snapshot;
pub mod tables;
