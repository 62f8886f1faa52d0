//! Map keys and values, constants and enums of bpf/include/inband/ (the
//! wire format, the MAC message, every program's maps), generated from the
//! C headers by build.rs, with layout tests comparing them with C.

#![allow(non_camel_case_types, non_upper_case_globals, dead_code, clippy::all)]

include!(concat!(env!("OUT_DIR"), "/shared.rs"));
