//! The balancer's control plane: `inband lb`.

pub mod apply;
pub mod attach;
pub mod balancer;
pub mod capture;
pub mod bpf;
pub mod config;
pub mod control;
pub mod daemon;
pub mod flow_query;
pub mod health;
pub mod maglev;
pub mod maps;
pub mod moves;
pub mod neighbour;
pub mod options_watch;
pub mod peers;
pub mod polling;
pub mod private;
pub mod query;
pub mod snapshot;
pub mod sweep;
pub mod tables;
