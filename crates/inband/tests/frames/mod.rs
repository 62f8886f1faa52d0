//! Frame pieces the balancer and agent fixtures both need beyond
//! `inband_testkit::packet`: raw IPv6 extension headers (RFC 8200 §4) to build
//! chains and malformed ones from, and frames cut short at a boundary.

use std::net::Ipv6Addr;

use inband_testkit::packet::{ETH_HLEN, IPV6_HLEN};

pub const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_IPV6: u8 = 41;

/// An extension header of the length-in-8-octet-units kind (Hop-by-Hop,
/// Routing, Destination Options): next header `next`, its length, then
/// `body` (6 bytes, or 6 + 8n).
pub fn ext(next: u8, body: &[u8]) -> Vec<u8> {
    assert_eq!((2 + body.len()) % 8, 0, "an extension header is 8n bytes");
    let mut h = vec![next, ((2 + body.len()) / 8 - 1) as u8];
    h.extend_from_slice(body);
    h
}

/// A Hop-by-Hop or Destination Options header holding the option TLVs
/// `options`, padded to 8n bytes with one Pad1 or one PadN.
pub fn opts_header(next: u8, options: &[u8]) -> Vec<u8> {
    let mut body = options.to_vec();
    match (8 - (2 + body.len()) % 8) % 8 {
        0 => {}
        1 => body.push(0),
        pad => {
            body.extend_from_slice(&[1, (pad - 2) as u8]);
            body.resize(body.len() + pad - 2, 0);
        }
    }
    ext(next, &body)
}

/// A Routing header with no segments left (type 4, segment routing): a
/// node that does not know it goes on to the next header (RFC 8200 §4.4).
pub fn routing(next: u8) -> Vec<u8> {
    ext(next, &[4, 0, 0, 0, 0, 0])
}

/// The IPv6 `frame` cut to its first `len` bytes, its payload length
/// saying so: a packet that ends at that byte, not one that lies about
/// its length.
pub fn cut6(frame: &[u8], len: usize) -> Vec<u8> {
    let mut f = frame[..len].to_vec();
    let payload = (len - ETH_HLEN - IPV6_HLEN) as u16;
    f[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&payload.to_be_bytes());
    f
}

/// The IPv4 `frame` wrapped in IP-in-IP as inband's carrier for paths that
/// strip options does it (bpf/include/inband/ipip.h): an outer header
/// without options, same addresses, the inner TOS, DF, TTL 64, protocol 4.
pub fn ipip(frame: &[u8]) -> Vec<u8> {
    let inner = &frame[ETH_HLEN..];
    let mut outer = [0u8; 20];
    outer[0] = 0x45;
    outer[1] = inner[1];
    outer[2..4].copy_from_slice(&((inner.len() + 20) as u16).to_be_bytes());
    outer[6] = 0x40;
    outer[8] = 64;
    outer[9] = 4;
    outer[12..20].copy_from_slice(&inner[12..20]);
    let check = inband_testkit::packet::checksum(&[&outer]);
    outer[10..12].copy_from_slice(&check.to_be_bytes());
    [&frame[..ETH_HLEN], &outer, inner].concat()
}

/// The next header that announces the IP packet `inner`: IPv4 in IPv6
/// (4, an IPv4 VIP's route) or IPv6 in IPv6 (41).
pub fn inner_proto(inner: &[u8]) -> u8 {
    if inner[0] >> 4 == 4 {
        4
    } else {
        IPPROTO_IPV6
    }
}

/// The IP packet `inner` (no Ethernet header) as an ECMP router sends it
/// to `sid` with `ip route ... encap seg6 mode encap segs SID`: an outer
/// header from `router`, a Segment Routing Header of that one segment with
/// `segments_left`, then `inner`; `reduced` (encap.red) leaves the SRH out.
/// The frame goes from `macs.0` to `macs.1`.
pub fn srv6(macs: ([u8; 6], [u8; 6]), router: Ipv6Addr, sid: Ipv6Addr, inner: &[u8], segments_left: u8, reduced: bool) -> Vec<u8> {
    let srh = if reduced {
        Vec::new()
    } else {
        // Routing type 4, segments left, last entry 0, flags, tag; the one segment.
        let mut body = vec![4, segments_left, 0, 0, 0, 0];
        body.extend_from_slice(&sid.octets());
        ext(inner_proto(inner), &body)
    };
    let mut f = macs.1.to_vec();
    f.extend_from_slice(&macs.0);
    f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend_from_slice(&((srh.len() + inner.len()) as u16).to_be_bytes());
    f.push(if reduced { inner_proto(inner) } else { IPPROTO_ROUTING });
    f.push(64);
    f.extend_from_slice(&router.octets());
    f.extend_from_slice(&sid.octets());
    f.extend_from_slice(&srh);
    f.extend_from_slice(inner);
    f
}

/// The IP packet `inner` as an ECMP router sends it from a shadow table
/// with an older generation behind it (`segs SID,NEXT`): an SRH of two
/// segments, `sid` active and `next` (segment 0, the path's last) to go,
/// segments left 1.
pub fn srv6_then(macs: ([u8; 6], [u8; 6]), router: Ipv6Addr, sid: Ipv6Addr, next: Ipv6Addr, inner: &[u8]) -> Vec<u8> {
    // Routing type 4, segments left 1, last entry 1, flags, tag; the segments last first.
    let mut body = vec![4, 1, 1, 0, 0, 0];
    body.extend_from_slice(&next.octets());
    body.extend_from_slice(&sid.octets());
    let srh = ext(inner_proto(inner), &body);
    let mut f = macs.1.to_vec();
    f.extend_from_slice(&macs.0);
    f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend_from_slice(&((srh.len() + inner.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[IPPROTO_ROUTING, 64]);
    f.extend_from_slice(&router.octets());
    f.extend_from_slice(&sid.octets());
    f.extend_from_slice(&srh);
    f.extend_from_slice(inner);
    f
}
