//! Which system call is which kind of time (docs/trace.md, "Categories"):
//! the only table of it. x86_64 numbers, whatever the build host (the
//! `syscalls` crate's copy of the kernel's syscall_64.tbl); a process calling
//! through the 32-bit or x32 entry points is misread, which docs/trace.md
//! says.

use syscalls::x86_64::Sysno;

use crate::bpf::shared::{INBAND_TRACE_CATEGORIES, INBAND_TRACE_NOT_COUNTED, INBAND_TRACE_NR_SLOTS};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Category {
    IoRead,
    IoWrite,
    /// Synchronisation and threading: waiting on another thread, on a
    /// timer or on readiness, and making threads.
    Sync,
    Memory,
    Other,
}

pub const ALL: [Category; INBAND_TRACE_CATEGORIES as usize] =
    [Category::IoRead, Category::IoWrite, Category::Sync, Category::Memory, Category::Other];

impl Category {
    pub fn name(self) -> &'static str {
        match self {
            Category::IoRead => "io_read",
            Category::IoWrite => "io_write",
            Category::Sync => "sync",
            Category::Memory => "memory",
            Category::Other => "other",
        }
    }

    /// Its number in the BPF maps (`inband_trace_thread_key.category`).
    pub fn index(self) -> usize {
        ALL.iter().position(|c| *c == self).unwrap()
    }
}

use Category::*;

/// Every call not listed is `Other`.
const TABLE: &[(Sysno, Category)] = &[
    (Sysno::read, IoRead),
    (Sysno::pread64, IoRead),
    (Sysno::readv, IoRead),
    (Sysno::recvfrom, IoRead),
    (Sysno::recvmsg, IoRead),
    (Sysno::readahead, IoRead),
    (Sysno::preadv, IoRead),
    (Sysno::recvmmsg, IoRead),
    (Sysno::preadv2, IoRead),
    (Sysno::write, IoWrite),
    (Sysno::pwrite64, IoWrite),
    (Sysno::writev, IoWrite),
    (Sysno::sendfile, IoWrite),
    (Sysno::sendto, IoWrite),
    (Sysno::sendmsg, IoWrite),
    // Flushing written data is the write's cost, paid later.
    (Sysno::msync, IoWrite),
    (Sysno::fsync, IoWrite),
    (Sysno::fdatasync, IoWrite),
    (Sysno::sync_file_range, IoWrite),
    (Sysno::pwritev, IoWrite),
    (Sysno::sendmmsg, IoWrite),
    (Sysno::copy_file_range, IoWrite),
    (Sysno::pwritev2, IoWrite),
    (Sysno::poll, Sync),
    (Sysno::select, Sync),
    (Sysno::sched_yield, Sync),
    (Sysno::nanosleep, Sync),
    (Sysno::clone, Sync),
    (Sysno::futex, Sync),
    (Sysno::clock_nanosleep, Sync),
    (Sysno::epoll_wait, Sync),
    (Sysno::pselect6, Sync),
    (Sysno::ppoll, Sync),
    (Sysno::epoll_pwait, Sync),
    (Sysno::membarrier, Sync),
    (Sysno::clone3, Sync),
    (Sysno::epoll_pwait2, Sync),
    (Sysno::futex_waitv, Sync),
    (Sysno::futex_wake, Sync),
    (Sysno::futex_wait, Sync),
    (Sysno::futex_requeue, Sync),
    (Sysno::mmap, Memory),
    (Sysno::mprotect, Memory),
    (Sysno::munmap, Memory),
    (Sysno::brk, Memory),
    (Sysno::mremap, Memory),
    (Sysno::mincore, Memory),
    (Sysno::madvise, Memory),
    (Sysno::mlock, Memory),
    (Sysno::munlock, Memory),
    (Sysno::mlockall, Memory),
    (Sysno::munlockall, Memory),
    (Sysno::mlock2, Memory),
    (Sysno::process_madvise, Memory),
    (Sysno::mseal, Memory),
];

pub fn of(nr: u32) -> Category {
    TABLE.iter().find(|(n, _)| n.id() as u32 == nr).map_or(Other, |(_, c)| *c)
}

/// The call's name; the last slot stands for every number beyond the
/// programs' range.
pub fn name(nr: u32) -> String {
    match Sysno::new(nr as usize) {
        _ if nr == INBAND_TRACE_NR_SLOTS - 1 => format!("nr>={nr}"),
        Some(sysno) => sysno.name().to_string(),
        None => format!("nr{nr}"),
    }
}

/// The tracer's own cost: the calls the kernel makes a traced thread take
/// for a uprobe on a 5-byte nop (the probe points of `--phases`) and for a
/// return probe. Counting them would charge the target one system call
/// per marker hit.
const NOT_COUNTED: [Sysno; 2] = [Sysno::uprobe, Sysno::uretprobe];

/// The program's `category_of`: each slot's category number.
pub fn by_slot() -> [u8; INBAND_TRACE_NR_SLOTS as usize] {
    std::array::from_fn(|nr| match NOT_COUNTED.iter().any(|s| s.id() as usize == nr) {
        true => INBAND_TRACE_NOT_COUNTED as u8,
        false => of(nr as u32).index() as u8,
    })
}
