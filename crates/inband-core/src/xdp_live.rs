//! Running an XDP program on a frame as if it had arrived on an interface
//! (BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES, Linux 5.18): the
//! verdict is carried out for real, so XDP_TX sends the frame out of that
//! interface and XDP_PASS hands it to the stack. The load generator sends
//! its frames this way; the balancer daemon re-runs the SYNs that dsr-query
//! held.

use std::os::fd::{AsRawFd, BorrowedFd};

use anyhow::{bail, Result};
use libbpf_rs::libbpf_sys;

const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;

/// Runs `prog` `repeat` times on `frame`, received on `ifindex`.
pub fn run(prog: BorrowedFd<'_>, ifindex: u32, frame: &[u8], repeat: u32) -> Result<()> {
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    let ctx: [u32; 6] = [0, frame.len() as u32, 0, ifindex, 0, 0];
    let mut opts = libbpf_sys::bpf_test_run_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _,
        data_in: frame.as_ptr().cast(),
        data_size_in: frame.len() as u32,
        ctx_in: ctx.as_ptr().cast(),
        ctx_size_in: std::mem::size_of_val(&ctx) as u32,
        repeat: repeat as i32,
        flags: BPF_F_TEST_XDP_LIVE_FRAMES,
        ..Default::default()
    };
    // SAFETY: every pointer in opts refers to a live buffer of the stated size.
    let rc = unsafe { libbpf_sys::bpf_prog_test_run_opts(prog.as_raw_fd(), &mut opts) };
    if rc != 0 {
        bail!("BPF_PROG_TEST_RUN (live frames): {}", std::io::Error::from_raw_os_error(-rc));
    }
    Ok(())
}
