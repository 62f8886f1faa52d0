//! A small builder and parser for Ethernet/IPv4-or-IPv6/TCP-or-UDP frames.
//!
//! Packet fixtures for BPF_PROG_TEST_RUN and the per-path benchmarks are built
//! with it, so a fixture reads as "a SYN from C to the VIP with option 155"
//! instead of hex. Written here rather than taken from a crate because the
//! fixtures need byte-exact control over malformed headers (bad IHL, options
//! that overrun, extension headers that lie about their length, truncation),
//! which packet crates refuse to produce.

use std::net::{IpAddr, SocketAddr};

pub const ETH_HLEN: usize = 14;
pub const IPV4_MIN_HLEN: usize = 20;
pub const IPV6_HLEN: usize = 40;
pub const TCP_MIN_HLEN: usize = 20;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_DSTOPTS: u8 = 60;
pub const IPPROTO_FRAGMENT: u8 = 44;
pub const IPPROTO_HOPOPTS: u8 = 0;

pub type Mac = [u8; 6];

/// One's-complement sum folded to 16 bits, as IPv4/TCP/UDP checksums use.
pub fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    let mut odd: Option<u8> = None;
    for chunk in chunks {
        for &b in chunk.iter() {
            match odd.take() {
                Some(hi) => sum += u32::from(u16::from_be_bytes([hi, b])),
                None => odd = Some(b),
            }
        }
    }
    if let Some(hi) = odd {
        sum += u32::from(u16::from_be_bytes([hi, 0]));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The transport checksum's pseudo-header (RFC 793 for IPv4, RFC 8200 8.1
/// for IPv6).
fn pseudo_header(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut p = Vec::with_capacity(12);
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.extend_from_slice(&[0, proto]);
            p.extend_from_slice(&(len as u16).to_be_bytes());
            p
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut p = Vec::with_capacity(40);
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.extend_from_slice(&(len as u32).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, proto]);
            p
        }
        _ => panic!("source {src} and destination {dst} are of different families"),
    }
}

/// A TCP or UDP segment in an IPv4 or IPv6 packet in an Ethernet frame.
#[derive(Clone, Debug)]
pub struct PacketBuilder {
    pub src_mac: Mac,
    pub dst_mac: Mac,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub proto: u8,
    /// TTL (IPv4) or hop limit (IPv6).
    pub ttl: u8,
    pub ip_id: u16,
    /// IPv4 flags + fragment offset field, host order (0x2000 = more fragments).
    pub frag: u16,
    /// IPv4: the header's options. IPv6: the extension headers between the
    /// fixed header and the transport, byte for byte (their own next-header
    /// fields as given), the first of type `ext_first`.
    pub ip_options: Vec<u8>,
    pub ext_first: u8,
    pub tcp_flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub window: u16,
    pub tcp_options: Vec<u8>,
    pub payload: Vec<u8>,
}

impl PacketBuilder {
    pub fn tcp(src: impl Into<SocketAddr>, dst: impl Into<SocketAddr>) -> Self {
        PacketBuilder {
            src_mac: [0x02, 0, 0, 0, 0, 0x01],
            dst_mac: [0x02, 0, 0, 0, 0, 0x02],
            src: src.into(),
            dst: dst.into(),
            proto: IPPROTO_TCP,
            ttl: 64,
            ip_id: 0x1234,
            frag: 0x4000, // don't fragment
            ip_options: Vec::new(),
            ext_first: IPPROTO_DSTOPTS,
            tcp_flags: TCP_ACK,
            seq: 1000,
            ack: 2000,
            window: 65535,
            tcp_options: Vec::new(),
            payload: Vec::new(),
        }
    }

    pub fn udp(src: impl Into<SocketAddr>, dst: impl Into<SocketAddr>) -> Self {
        PacketBuilder { proto: IPPROTO_UDP, ..Self::tcp(src, dst) }
    }

    pub fn is_ipv4(&self) -> bool {
        self.src.is_ipv4()
    }

    pub fn macs(mut self, src: Mac, dst: Mac) -> Self {
        self.src_mac = src;
        self.dst_mac = dst;
        self
    }
    pub fn flags(mut self, flags: u8) -> Self {
        self.tcp_flags = flags;
        self
    }
    /// A SYN with an MSS option, as a Linux client sends it.
    pub fn syn(self, mss: u16) -> Self {
        self.flags(TCP_SYN).ack_no(0).tcp_options(mss_option(mss).to_vec())
    }
    pub fn seq_no(mut self, seq: u32) -> Self {
        self.seq = seq;
        self
    }
    pub fn ack_no(mut self, ack: u32) -> Self {
        self.ack = ack;
        self
    }
    pub fn ip_options(mut self, opts: Vec<u8>) -> Self {
        self.ip_options = opts;
        self
    }
    /// IPv6: extension headers of first type `first`, raw.
    pub fn ext_headers(mut self, first: u8, bytes: Vec<u8>) -> Self {
        self.ext_first = first;
        self.ip_options = bytes;
        self
    }
    /// The inband option where its family carries it: an IPv4 option, or
    /// an IPv6 Destination Options header around it (inband_core::wire::doh).
    pub fn inband(self, option: &[u8]) -> Self {
        if self.is_ipv4() {
            self.ip_options(option.to_vec())
        } else {
            let proto = self.proto;
            self.ext_headers(IPPROTO_DSTOPTS, inband_core::wire::doh(option, proto))
        }
    }
    pub fn tcp_options(mut self, opts: Vec<u8>) -> Self {
        self.tcp_options = opts;
        self
    }
    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = payload.into();
        self
    }
    pub fn frag(mut self, frag: u16) -> Self {
        self.frag = frag;
        self
    }

    fn l4(&self) -> Vec<u8> {
        let (src, dst) = (self.src.ip(), self.dst.ip());
        let mut l4 = Vec::new();
        l4.extend_from_slice(&self.src.port().to_be_bytes());
        l4.extend_from_slice(&self.dst.port().to_be_bytes());
        if self.proto == IPPROTO_TCP {
            assert!(self.tcp_options.len() % 4 == 0, "TCP options must be padded to 4 bytes");
            let hlen = TCP_MIN_HLEN + self.tcp_options.len();
            l4.extend_from_slice(&self.seq.to_be_bytes());
            l4.extend_from_slice(&self.ack.to_be_bytes());
            l4.push(((hlen / 4) as u8) << 4);
            l4.push(self.tcp_flags);
            l4.extend_from_slice(&self.window.to_be_bytes());
            l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
            l4.extend_from_slice(&self.tcp_options);
            l4.extend_from_slice(&self.payload);
            let sum = checksum(&[&pseudo_header(src, dst, IPPROTO_TCP, l4.len()), &l4]);
            l4[16..18].copy_from_slice(&sum.to_be_bytes());
        } else {
            let len = 8 + self.payload.len();
            l4.extend_from_slice(&(len as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
            l4.extend_from_slice(&self.payload);
            let sum = checksum(&[&pseudo_header(src, dst, IPPROTO_UDP, len), &l4]);
            l4[6..8].copy_from_slice(&(if sum == 0 { 0xffff } else { sum }).to_be_bytes());
        }
        l4
    }

    /// The IP packet: IPv4 header (options, a correct checksum) or IPv6
    /// header and extension headers, then the transport.
    pub fn build_ip(&self) -> Vec<u8> {
        let l4 = self.l4();
        match (self.src.ip(), self.dst.ip()) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                assert!(self.ip_options.len() % 4 == 0, "IP options must be padded to 4 bytes");
                let hlen = IPV4_MIN_HLEN + self.ip_options.len();
                let mut ip = Vec::with_capacity(hlen + l4.len());
                ip.push(0x40 | (hlen / 4) as u8);
                ip.push(0);
                ip.extend_from_slice(&((hlen + l4.len()) as u16).to_be_bytes());
                ip.extend_from_slice(&self.ip_id.to_be_bytes());
                ip.extend_from_slice(&self.frag.to_be_bytes());
                ip.push(self.ttl);
                ip.push(self.proto);
                ip.extend_from_slice(&[0, 0]);
                ip.extend_from_slice(&src.octets());
                ip.extend_from_slice(&dst.octets());
                ip.extend_from_slice(&self.ip_options);
                let sum = checksum(&[&ip]);
                ip[10..12].copy_from_slice(&sum.to_be_bytes());
                ip.extend_from_slice(&l4);
                ip
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                let mut ip = Vec::with_capacity(IPV6_HLEN + self.ip_options.len() + l4.len());
                ip.extend_from_slice(&[0x60, 0, 0, 0]);
                ip.extend_from_slice(&((self.ip_options.len() + l4.len()) as u16).to_be_bytes());
                ip.push(if self.ip_options.is_empty() { self.proto } else { self.ext_first });
                ip.push(self.ttl);
                ip.extend_from_slice(&src.octets());
                ip.extend_from_slice(&dst.octets());
                ip.extend_from_slice(&self.ip_options);
                ip.extend_from_slice(&l4);
                ip
            }
            _ => panic!("source {} and destination {} are of different families", self.src, self.dst),
        }
    }

    /// The whole Ethernet frame.
    pub fn build(&self) -> Vec<u8> {
        let mut frame = Vec::new();
        frame.extend_from_slice(&self.dst_mac);
        frame.extend_from_slice(&self.src_mac);
        frame.extend_from_slice(&(if self.is_ipv4() { 0x0800u16 } else { 0x86dd }).to_be_bytes());
        frame.extend_from_slice(&self.build_ip());
        frame
    }
}

pub fn mss_option(mss: u16) -> [u8; 4] {
    let m = mss.to_be_bytes();
    [2, 4, m[0], m[1]]
}

/// What a test asserts on in an output frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub src_mac: Mac,
    pub dst_mac: Mac,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub proto: u8,
    /// IPv4 options, or IPv6 extension headers (raw).
    pub ip_options: Vec<u8>,
    /// TTL or hop limit.
    pub ttl: u8,
    pub tcp_flags: u8,
    pub tcp_options: Vec<u8>,
    pub payload: Vec<u8>,
    /// The IPv4 header checksum (IPv6 has none) and the transport checksum
    /// both verify.
    pub checksums_ok: bool,
}

impl Parsed {
    /// The MSS option's value, if the TCP options carry one.
    pub fn mss(&self) -> Option<u16> {
        let o = &self.tcp_options;
        let mut i = 0;
        while i < o.len() {
            match o[i] {
                0 => return None,
                1 => i += 1,
                2 if i + 4 <= o.len() => return Some(u16::from_be_bytes([o[i + 2], o[i + 3]])),
                _ if i + 1 < o.len() && o[i + 1] >= 2 => i += o[i + 1] as usize,
                _ => return None,
            }
        }
        None
    }
}

/// Parses an Ethernet/IPv4-or-IPv6/TCP-or-UDP frame; `None` if it is not
/// one. IPv6 extension headers are walked by their lengths (any type but a
/// fragment's).
pub fn parse(frame: &[u8]) -> Option<Parsed> {
    if frame.len() < ETH_HLEN + IPV4_MIN_HLEN {
        return None;
    }
    let ip = &frame[ETH_HLEN..];
    let (src_ip, dst_ip, proto, hlen, total, ttl, options, ip_ok) = match frame[12..14] {
        [0x08, 0x00] => {
            let hlen = usize::from(ip[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            if ip[0] >> 4 != 4 || hlen < IPV4_MIN_HLEN || total < hlen || total > ip.len() {
                return None;
            }
            let s: [u8; 4] = ip[12..16].try_into().unwrap();
            let d: [u8; 4] = ip[16..20].try_into().unwrap();
            (IpAddr::from(s), IpAddr::from(d), ip[9], hlen, total, ip[8], ip[IPV4_MIN_HLEN..hlen].to_vec(), checksum(&[&ip[..hlen]]) == 0)
        }
        [0x86, 0xdd] => {
            if ip.len() < IPV6_HLEN || ip[0] >> 4 != 6 {
                return None;
            }
            let total = IPV6_HLEN + usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            if total > ip.len() {
                return None;
            }
            let (mut nh, mut off) = (ip[6], IPV6_HLEN);
            while matches!(nh, IPPROTO_HOPOPTS | 43 | IPPROTO_DSTOPTS) {
                if off + 2 > total {
                    return None;
                }
                let len = (usize::from(ip[off + 1]) + 1) * 8;
                nh = ip[off];
                off += len;
            }
            if off > total {
                return None;
            }
            let s: [u8; 16] = ip[8..24].try_into().unwrap();
            let d: [u8; 16] = ip[24..40].try_into().unwrap();
            (IpAddr::from(s), IpAddr::from(d), nh, off, total, ip[7], ip[IPV6_HLEN..off].to_vec(), true)
        }
        _ => return None,
    };
    let l4 = &ip[hlen..total];
    if l4.len() < 8 {
        return None;
    }
    let sport = u16::from_be_bytes([l4[0], l4[1]]);
    let dport = u16::from_be_bytes([l4[2], l4[3]]);
    let (tcp_flags, tcp_options, payload) = if proto == IPPROTO_TCP {
        if l4.len() < TCP_MIN_HLEN {
            return None;
        }
        let thlen = usize::from(l4[12] >> 4) * 4;
        if thlen < TCP_MIN_HLEN || thlen > l4.len() {
            return None;
        }
        (l4[13], l4[TCP_MIN_HLEN..thlen].to_vec(), l4[thlen..].to_vec())
    } else {
        (0, Vec::new(), l4[8..].to_vec())
    };
    // A UDP datagram over IPv4 may go without a checksum (0).
    let no_udp_sum = proto == IPPROTO_UDP && src_ip.is_ipv4() && l4[6..8] == [0, 0];
    let l4_ok = no_udp_sum || checksum(&[&pseudo_header(src_ip, dst_ip, proto, l4.len()), l4]) == 0;
    Some(Parsed {
        dst_mac: frame[0..6].try_into().unwrap(),
        src_mac: frame[6..12].try_into().unwrap(),
        src: SocketAddr::new(src_ip, sport),
        dst: SocketAddr::new(dst_ip, dport),
        proto,
        ip_options: options,
        ttl,
        tcp_flags,
        tcp_options,
        payload,
        checksums_ok: ip_ok && l4_ok,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_frames_parse_back_with_valid_checksums() {
        let c: SocketAddr = "10.0.0.1:40000".parse().unwrap();
        let v: SocketAddr = "10.0.0.100:80".parse().unwrap();
        let f = PacketBuilder::tcp(c, v).syn(1460).ip_options(vec![124, 4, 0, 0]).payload(b"hi".to_vec()).build();
        let p = parse(&f).unwrap();
        assert!(p.checksums_ok);
        assert_eq!((p.src, p.dst, p.tcp_flags), (c, v, TCP_SYN));
        assert_eq!(p.ip_options, vec![124, 4, 0, 0]);
        assert_eq!(p.mss(), Some(1460));
        assert_eq!(p.payload, b"hi");
        // One flipped payload bit must break the L4 checksum.
        let mut bad = f.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(!parse(&bad).unwrap().checksums_ok);
    }

    #[test]
    fn udp_checksum_verifies() {
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:53".parse().unwrap();
        let p = parse(&PacketBuilder::udp(a, b).payload(vec![1, 2, 3]).build()).unwrap();
        assert!(p.checksums_ok);
        assert_eq!(p.payload, vec![1, 2, 3]);
    }

    /// IPv6 with a Destination Options header: the transport checksum
    /// covers no extension header, and the parser walks past it.
    #[test]
    fn ipv6_frames_with_an_extension_header_parse_back() {
        let c: SocketAddr = "[2001:db8::1]:40000".parse().unwrap();
        let v: SocketAddr = "[2001:db8::100]:443".parse().unwrap();
        for p in [PacketBuilder::tcp(c, v).syn(1440), PacketBuilder::udp(c, v).payload(vec![0x40; 30])] {
            let plain = parse(&p.build()).unwrap();
            let f = p.clone().inband(&[124, 4, 0, 0]).build();
            assert_eq!(&f[12..14], &[0x86, 0xdd]);
            let q = parse(&f).unwrap();
            assert!(q.checksums_ok && plain.checksums_ok);
            assert_eq!((q.src, q.dst, q.proto, q.ttl), (c, v, p.proto, 64));
            assert_eq!(q.ip_options, inband_core::wire::doh(&[124, 4, 0, 0], p.proto));
            assert_eq!(q.payload, plain.payload);
        }
    }
}
