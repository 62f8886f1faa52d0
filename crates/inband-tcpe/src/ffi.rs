//! The client's C ABI (include/inband_tcpe.h): the same stream as
//! `client::Client`, for programs not written in Rust. Errors are reported
//! as a NULL or -1 return with errno set, as the socket calls they stand
//! in for do; the cause goes to the log (INBAND_LOG).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::client::Client;
use crate::sockops::Tcpe;

/// The loaded program, shared by the connections opened through it.
pub struct InbandTcpe(Arc<Tcpe>);

/// A Rust host that has loaded the program hands C code a handle to it
/// (freed by `inband_tcpe_detach`, which detaches only when the last
/// holder lets go).
impl From<Arc<Tcpe>> for InbandTcpe {
    fn from(t: Arc<Tcpe>) -> InbandTcpe {
        InbandTcpe(t)
    }
}

fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = e };
}

fn errno_of(e: &std::io::Error) -> c_int {
    e.raw_os_error().unwrap_or(match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => libc::ETIMEDOUT,
        _ => libc::EIO,
    })
}

fn str_arg<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated string (header contract).
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// Loads the TCPE program and attaches it to the cgroup v2 directory
/// `cgroup`; NULL on failure (errno EINVAL for a bad argument, EPERM
/// otherwise: loading needs CAP_BPF and CAP_NET_ADMIN).
#[no_mangle]
pub extern "C" fn inband_tcpe_attach(cgroup: *const c_char) -> *mut InbandTcpe {
    let Some(cg) = str_arg(cgroup) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    match Tcpe::attach(Path::new(cg)) {
        Ok(t) => Box::into_raw(Box::new(InbandTcpe(Arc::new(t)))),
        Err(e) => {
            tracing::warn!("inband_tcpe_attach: {e:#}");
            set_errno(libc::EPERM);
            std::ptr::null_mut()
        }
    }
}

/// Lets go of the program; it is detached once no connection opened
/// through it is open (each holds it, to read its notifications).
///
/// # Safety
/// `t` is NULL or a pointer `inband_tcpe_attach` returned, not detached yet.
#[no_mangle]
pub unsafe extern "C" fn inband_tcpe_detach(t: *mut InbandTcpe) {
    if !t.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(t) });
    }
}

/// Connects to `addr` ("192.0.2.1:80" or "[2001:db8::1]:80") with TCPE
/// offered; `timeout_ms` bounds the connect, each join and each read's
/// wait. NULL on failure, with errno.
///
/// # Safety
/// `t` is a live pointer from `inband_tcpe_attach`; `addr` a C string.
#[no_mangle]
pub unsafe extern "C" fn inband_tcpe_connect(t: *const InbandTcpe, addr: *const c_char, timeout_ms: u32) -> *mut Client {
    let (Some(t), Some(addr)) = (unsafe { t.as_ref() }, str_arg(addr).and_then(|a| a.parse::<SocketAddr>().ok())) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    match Client::connect(t.0.clone(), addr, Duration::from_millis(timeout_ms.into())) {
        Ok(c) => Box::into_raw(Box::new(c)),
        Err(e) => {
            tracing::debug!("inband_tcpe_connect: {e:#}");
            let errno = e.downcast_ref::<std::io::Error>().map(errno_of).unwrap_or(libc::ECONNREFUSED);
            set_errno(errno);
            std::ptr::null_mut()
        }
    }
}

/// Like read(2) on the connection's one stream: 0 at its end.
///
/// # Safety
/// `c` is a live pointer from `inband_tcpe_connect`; `buf` holds `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn inband_tcpe_read(c: *mut Client, buf: *mut c_void, len: usize) -> isize {
    let Some(c) = (unsafe { c.as_mut() }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    // SAFETY: the caller's contract.
    let b = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
    match c.read(b) {
        Ok(n) => n as isize,
        Err(e) => {
            set_errno(errno_of(&e));
            -1
        }
    }
}

/// Like write(2) on the connection's current subflow.
///
/// # Safety
/// `c` is a live pointer from `inband_tcpe_connect`; `buf` holds `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn inband_tcpe_write(c: *mut Client, buf: *const c_void, len: usize) -> isize {
    let Some(c) = (unsafe { c.as_mut() }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    // SAFETY: the caller's contract.
    let b = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
    match c.write(b) {
        Ok(n) => n as isize,
        Err(e) => {
            set_errno(errno_of(&e));
            -1
        }
    }
}

/// 1 once the stream goes on on a joined subflow, else 0.
///
/// # Safety
/// `c` is a live pointer from `inband_tcpe_connect`.
#[no_mangle]
pub unsafe extern "C" fn inband_tcpe_moved(c: *const Client) -> c_int {
    unsafe { c.as_ref() }.is_some_and(|c| c.counters().get("moved") > 0).into()
}

/// Closes every subflow of the connection and frees it.
///
/// # Safety
/// `c` is NULL or a live pointer from `inband_tcpe_connect`, not closed yet.
#[no_mangle]
pub unsafe extern "C" fn inband_tcpe_close(c: *mut Client) {
    if !c.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(c) });
    }
}
