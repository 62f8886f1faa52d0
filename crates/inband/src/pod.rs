//! Plain-old-data views of the `#[repr(C)]` map keys and values shared with
//! the BPF programs, so they can be handed to libbpf as bytes.

/// # Safety
/// Implement only for `#[repr(C)]` structs of integers whose every bit
/// pattern is valid and that have no implicit padding (the C headers pad
/// explicitly; `layout` tests check the sizes against C).
pub unsafe trait Pod: Copy + Default {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: Pod types are padding-free integer structs.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), std::mem::size_of::<Self>()) }
    }

    /// Reads a value from map bytes; short input is zero-extended so a
    /// truncated read can never produce uninitialised memory.
    fn from_bytes(bytes: &[u8]) -> Self {
        let mut v = Self::default();
        let n = bytes.len().min(std::mem::size_of::<Self>());
        // SAFETY: any bit pattern is a valid Pod; n bounds both buffers.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (&mut v as *mut Self).cast::<u8>(), n) };
        v
    }
}

macro_rules! pod {
    ($($t:ty),* $(,)?) => { $(unsafe impl $crate::pod::Pod for $t {})* };
}
pub(crate) use pod;

unsafe impl Pod for u8 {}
unsafe impl Pod for u16 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for u64 {}
unsafe impl Pod for i64 {}

/// An IPv4 address as the BPF maps hold it: network-order bytes in a u32.
pub fn be_addr(ip: std::net::Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}
pub fn addr_of(be: u32) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(be.to_ne_bytes())
}
/// A port as the BPF maps hold it: network-order bytes in a u16.
pub fn be_port(port: u16) -> u16 {
    port.to_be()
}
pub fn port_of(be: u16) -> u16 {
    u16::from_be(be)
}
