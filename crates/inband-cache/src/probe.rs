//! Probe points for `inband trace --phases` (docs/trace.md, "Built-in phase
//! sets"): functions that do nothing, called where a phase begins, for the
//! tracer's uprobes. Here because every program with probe points (the
//! cache's stores, the proxy) depends on this crate.
//!
//! Why not a uprobe on the function that does the work: the first
//! instruction of a Rust function is usually one the kernel cannot emulate
//! (`sub $n,%rsp`), so the uprobe single-steps it out of line, two traps,
//! about 16 µs a hit on this project's VMs; on a nop it is emulated, about
//! 0.4 µs (and kernels from 6.18 turn a uprobe on this 5-byte nop into a
//! call without a trap).

/// Defines one out-of-line function per name whose first instruction is a
/// 5-byte nop. The nop carries the point's name in an assembler comment:
/// identical bodies would be merged into one address by LLVM, and one
/// uprobe would then count every point.
#[macro_export]
macro_rules! probe_points {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[inline(never)]
        pub fn $name() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a nop: no register, flag or memory changes.
            unsafe {
                ::core::arch::asm!(
                    concat!(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00 # inband probe point ", module_path!(), "::", stringify!($name)),
                    options(nomem, nostack, preserves_flags)
                )
            }
        }
    )*};
}

crate::probe_points!(
    /// [`crate::Store::get`] of any backend begins.
    store_get,
    /// [`crate::Store::put`] begins.
    store_put,
    /// [`crate::Store::delete`] begins.
    store_delete,
);
