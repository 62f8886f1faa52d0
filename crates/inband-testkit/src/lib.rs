//! What tests and benchmarks run inband with: namespace testbeds, the
//! workload server (`inband serve`), a packet builder, and the `inband
//! bench` measurements. Nothing a production daemon needs lives here.

pub mod bench;
pub mod bpf;
pub mod packet;
pub mod pcap;
pub mod testbed;
pub mod workload;
