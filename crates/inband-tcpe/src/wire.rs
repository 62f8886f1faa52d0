//! The TCPE options as bytes: building and parsing them, and their MAC.
//! Constants and the MAC message's layout come from
//! bpf/include/inband/tcpe/wire.h (bindgen), the one definition the
//! sockops program compiles too. Every input is attacker-controlled:
//! parsing never reads past what it was given and refuses every length,
//! ExID and flag the format does not define.

use std::fmt;
use std::hash::Hasher;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use siphasher::sip::SipHasher24;

use crate::bpf::shared as c;

pub const KIND: u8 = c::INBAND_TCPE_KIND as u8;
pub const EXID_CONN_ID: u16 = c::INBAND_TCPE_EXID_CONN_ID as u16;
pub const EXID_PATH4: u16 = c::INBAND_TCPE_EXID_PATH4 as u16;
pub const EXID_KEY: u16 = c::INBAND_TCPE_EXID_KEY as u16;
pub const EXID_PATH6: u16 = c::INBAND_TCPE_EXID_PATH6 as u16;
pub const HDR_LEN: usize = c::INBAND_TCPE_HDR_LEN as usize;
pub const CONN_ID_LEN: usize = c::INBAND_TCPE_CONN_ID_LEN as usize;
pub const KEY_LEN: usize = c::INBAND_TCPE_KEY_LEN as usize;
pub const PATH4_SEED_LEN: usize = c::INBAND_TCPE_PATH4_SEED_LEN as usize;
pub const PATH4_LEN: usize = c::INBAND_TCPE_PATH4_LEN as usize;
pub const PATH6_LEN: usize = c::INBAND_TCPE_PATH6_LEN as usize;
pub const MAC_LEN: usize = c::INBAND_TCPE_MAC_LEN as usize;
const FLAG_CREATE: u8 = c::INBAND_TCPE_FLAG_CREATE as u8;
const FLAG_RESERVED: u8 = c::INBAND_TCPE_FLAG_RESERVED as u8;
const PRIO_SHIFT: u32 = c::INBAND_TCPE_PRIO_SHIFT;

/// Which end of the connection sent a notification (its MAC names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Opened the connection: the client.
    Active,
    /// Accepted it: the balancer (later, the server that took over).
    Passive,
}

impl Role {
    pub fn number(self) -> u8 {
        match self {
            Role::Active => c::INBAND_TCPE_ACTIVE as u8,
            Role::Passive => c::INBAND_TCPE_PASSIVE as u8,
        }
    }

    pub fn from_number(n: u32) -> Option<Role> {
        match n {
            c::INBAND_TCPE_ACTIVE => Some(Role::Active),
            c::INBAND_TCPE_PASSIVE => Some(Role::Passive),
            _ => None,
        }
    }
}

/// What a path notification says: open (`create`) or close a subflow to
/// `addr`, with a priority of 0-15.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    pub addr: SocketAddr,
    pub priority: u8,
    pub create: bool,
}

impl Path {
    /// The wire's flags byte.
    pub fn flags(&self) -> Result<u8, WireError> {
        if self.priority > 15 {
            return Err(WireError::Priority(self.priority));
        }
        Ok((self.priority << PRIO_SHIFT) | if self.create { FLAG_CREATE } else { 0 })
    }

    fn from_flags(addr: SocketAddr, flags: u8) -> Result<Path, WireError> {
        if flags & FLAG_RESERVED != 0 {
            return Err(WireError::ReservedFlags(flags));
        }
        Ok(Path { addr, priority: flags >> PRIO_SHIFT, create: flags & FLAG_CREATE != 0 })
    }

    /// The path as the maps hold it (`struct inband_tcpe_path`).
    pub fn to_c(&self, serial: u8) -> Result<c::inband_tcpe_path, WireError> {
        let mut p = c::inband_tcpe_path { flags: self.flags()?, serial, port: self.addr.port().to_be(), ..Default::default() };
        match self.addr.ip() {
            IpAddr::V4(a) => {
                p.family = 4;
                p.addr[..4].copy_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                p.family = 6;
                p.addr = a.octets();
            }
        }
        Ok(p)
    }

    /// The path and serial of a map's `struct inband_tcpe_path`; None for
    /// family 0 (no path).
    pub fn from_c(p: &c::inband_tcpe_path) -> Result<Option<(Path, u8)>, WireError> {
        let ip = match p.family {
            0 => return Ok(None),
            4 => IpAddr::V4(Ipv4Addr::new(p.addr[0], p.addr[1], p.addr[2], p.addr[3])),
            6 => IpAddr::V6(Ipv6Addr::from(p.addr)),
            f => return Err(WireError::Family(f)),
        };
        let addr = SocketAddr::new(ip, u16::from_be(p.port));
        Ok(Some((Path::from_flags(addr, p.flags)?, p.serial)))
    }
}

/// The two key halves the handshake exchanged: the MAC's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keys {
    pub active: u64,
    pub passive: u64,
}

/// One TCPE option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpeOption {
    /// On the SYN (the client's choice), the SYN-ACK (echoed) and the
    /// client's third ACK (its confirmation).
    ConnId(u32),
    /// A key half: the client's on the SYN, the listener's on the SYN-ACK.
    Key(u64),
    /// The seed's IPv4 path option: no serial, no MAC. Receivers refuse it.
    SeedPath(Path),
    /// An authenticated path notification, IPv4 or IPv6.
    Path { path: Path, serial: u8, mac: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than the option header or its length byte says.
    Truncated { need: usize, have: usize },
    /// Not kind 254.
    NotTcpe(u8),
    /// An ExID this format does not define.
    UnknownExid(u16),
    /// A length its ExID does not have.
    Length { exid: u16, len: usize },
    /// Bits 2-0 of the flags byte are set.
    ReservedFlags(u8),
    /// The seed's option's pad byte is not zero.
    Pad(u8),
    /// A priority above 15.
    Priority(u8),
    /// The seed's path option carries IPv4 only.
    SeedIpv6,
    /// A map's path of a family other than 4 or 6.
    Family(u8),
    /// A TCP option other than TCPE with a length below 2 or past the end.
    BadTcpOption { kind: u8, len: usize },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated { need, have } => write!(f, "TCPE option truncated: {have} bytes of {need}"),
            WireError::NotTcpe(k) => write!(f, "TCP option kind {k} is not TCPE (254)"),
            WireError::UnknownExid(e) => write!(f, "unknown TCPE experiment ID {e}"),
            WireError::Length { exid, len } => write!(f, "TCPE option {exid} cannot be {len} bytes long"),
            WireError::ReservedFlags(b) => write!(f, "TCPE path flags {b:#04x} set reserved bits 2-0"),
            WireError::Pad(b) => write!(f, "TCPE seed path option's pad byte is {b:#04x}, not 0"),
            WireError::Priority(p) => write!(f, "TCPE path priority {p} is above 15"),
            WireError::SeedIpv6 => write!(f, "the seed's TCPE path option carries IPv4 only"),
            WireError::Family(x) => write!(f, "TCPE path of address family {x}"),
            WireError::BadTcpOption { kind, len } => write!(f, "TCP option {kind} of length {len} does not fit the header"),
        }
    }
}

impl std::error::Error for WireError {}

fn hdr(len: usize, exid: u16) -> [u8; HDR_LEN] {
    let e = exid.to_be_bytes();
    [KIND, len as u8, e[0], e[1]]
}

pub fn conn_id_option(id: u32) -> [u8; CONN_ID_LEN] {
    let mut o = [0u8; CONN_ID_LEN];
    o[..HDR_LEN].copy_from_slice(&hdr(CONN_ID_LEN, EXID_CONN_ID));
    o[HDR_LEN..].copy_from_slice(&id.to_be_bytes());
    o
}

pub fn key_option(key: u64) -> [u8; KEY_LEN] {
    let mut o = [0u8; KEY_LEN];
    o[..HDR_LEN].copy_from_slice(&hdr(KEY_LEN, EXID_KEY));
    o[HDR_LEN..].copy_from_slice(&key.to_le_bytes());
    o
}

/// The seed's 12-byte option (IPv4 only): for tests of the receivers'
/// refusal and for talking about the seed, never sent by the program.
pub fn seed_path_option(path: &Path) -> Result<[u8; PATH4_SEED_LEN], WireError> {
    let IpAddr::V4(a) = path.addr.ip() else { return Err(WireError::SeedIpv6) };
    let mut o = [0u8; PATH4_SEED_LEN];
    o[..HDR_LEN].copy_from_slice(&hdr(PATH4_SEED_LEN, EXID_PATH4));
    o[4..8].copy_from_slice(&a.octets());
    o[8..10].copy_from_slice(&path.addr.port().to_be_bytes());
    o[10] = path.flags()?;
    Ok(o)
}

/// The MAC of `path` with `serial`, sent by `sender` on connection
/// `conn_id` (wire.h, struct inband_tcpe_mac_msg).
pub fn path_mac(keys: &Keys, conn_id: u32, sender: Role, path: &Path, serial: u8) -> Result<u32, WireError> {
    let p = path.to_c(serial)?;
    let mut m = c::inband_tcpe_mac_msg {
        tag: *b"TCPE",
        conn_id: conn_id.to_be(),
        dir: sender.number(),
        family: p.family,
        flags: p.flags,
        serial,
        port: p.port,
        ..Default::default()
    };
    m.addr = p.addr;
    // SAFETY: a repr(C) struct of integers with no implicit padding (its
    // size is asserted to be 32 in C and by bindgen's layout test).
    let bytes = unsafe {
        std::slice::from_raw_parts((&m as *const c::inband_tcpe_mac_msg).cast::<u8>(), std::mem::size_of_val(&m))
    };
    let mut h = SipHasher24::new_with_keys(keys.active, keys.passive);
    h.write(bytes);
    Ok(h.finish() as u32)
}

/// The authenticated path option: 16 bytes for IPv4, 28 for IPv6.
pub fn path_option(path: &Path, serial: u8, keys: &Keys, conn_id: u32, sender: Role) -> Result<Vec<u8>, WireError> {
    let mac = path_mac(keys, conn_id, sender, path, serial)?;
    encode_path(path, serial, mac)
}

fn encode_path(path: &Path, serial: u8, mac: u32) -> Result<Vec<u8>, WireError> {
    let (exid, addr): (u16, Vec<u8>) = match path.addr.ip() {
        IpAddr::V4(a) => (EXID_PATH4, a.octets().to_vec()),
        IpAddr::V6(a) => (EXID_PATH6, a.octets().to_vec()),
    };
    let len = HDR_LEN + addr.len() + 2 + 1 + 1 + MAC_LEN;
    let mut o = Vec::with_capacity(len);
    o.extend_from_slice(&hdr(len, exid));
    o.extend_from_slice(&addr);
    o.extend_from_slice(&path.addr.port().to_be_bytes());
    o.push(path.flags()?);
    o.push(serial);
    o.extend_from_slice(&mac.to_le_bytes());
    Ok(o)
}

impl TcpeOption {
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        Ok(match self {
            TcpeOption::ConnId(id) => conn_id_option(*id).to_vec(),
            TcpeOption::Key(k) => key_option(*k).to_vec(),
            TcpeOption::SeedPath(p) => seed_path_option(p)?.to_vec(),
            TcpeOption::Path { path, serial, mac } => encode_path(path, *serial, *mac)?,
        })
    }

    /// Whether a path option's MAC is `sender`'s under `keys` on
    /// `conn_id`. Other options carry no MAC: false.
    pub fn verify(&self, keys: &Keys, conn_id: u32, sender: Role) -> bool {
        match self {
            TcpeOption::Path { path, serial, mac } => path_mac(keys, conn_id, sender, path, *serial) == Ok(*mac),
            _ => false,
        }
    }
}

/// Parses the one option at the start of `b` (which may go on past it).
/// Returns it and its length.
pub fn parse(b: &[u8]) -> Result<(TcpeOption, usize), WireError> {
    if b.len() < 2 {
        return Err(WireError::Truncated { need: 2, have: b.len() });
    }
    if b[0] != KIND {
        return Err(WireError::NotTcpe(b[0]));
    }
    let len = b[1] as usize;
    if len < HDR_LEN {
        return Err(WireError::Length { exid: 0, len });
    }
    if b.len() < len {
        return Err(WireError::Truncated { need: len, have: b.len() });
    }
    let exid = u16::from_be_bytes([b[2], b[3]]);
    let o = &b[..len];
    let opt = match (exid, len) {
        (EXID_CONN_ID, CONN_ID_LEN) => TcpeOption::ConnId(u32::from_be_bytes(o[4..8].try_into().unwrap())),
        (EXID_KEY, KEY_LEN) => TcpeOption::Key(u64::from_le_bytes(o[4..12].try_into().unwrap())),
        (EXID_PATH4, PATH4_SEED_LEN) => {
            if o[11] != 0 {
                return Err(WireError::Pad(o[11]));
            }
            let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(o[4], o[5], o[6], o[7])), u16::from_be_bytes([o[8], o[9]]));
            TcpeOption::SeedPath(Path::from_flags(addr, o[10])?)
        }
        (EXID_PATH4, PATH4_LEN) => {
            let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(o[4], o[5], o[6], o[7])), u16::from_be_bytes([o[8], o[9]]));
            TcpeOption::Path {
                path: Path::from_flags(addr, o[10])?,
                serial: o[11],
                mac: u32::from_le_bytes(o[12..16].try_into().unwrap()),
            }
        }
        (EXID_PATH6, PATH6_LEN) => {
            let ip: [u8; 16] = o[4..20].try_into().unwrap();
            let addr = SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), u16::from_be_bytes([o[20], o[21]]));
            TcpeOption::Path {
                path: Path::from_flags(addr, o[22])?,
                serial: o[23],
                mac: u32::from_le_bytes(o[24..28].try_into().unwrap()),
            }
        }
        (EXID_CONN_ID | EXID_KEY | EXID_PATH4 | EXID_PATH6, _) => return Err(WireError::Length { exid, len }),
        _ => return Err(WireError::UnknownExid(exid)),
    };
    Ok((opt, len))
}

/// The TCPE options among a TCP header's options (the bytes after the
/// fixed 20): other kinds are skipped, a malformed TCPE option or an
/// option that overruns the area is an error; kind 254 with an ExID of
/// another experiment (TCP Fast Open's) is skipped.
pub fn options(area: &[u8]) -> Result<Vec<TcpeOption>, WireError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < area.len() {
        match area[i] {
            0 => break,
            1 => {
                i += 1;
                continue;
            }
            kind => {
                let len = area.get(i + 1).copied().unwrap_or(0) as usize;
                if len < 2 || i + len > area.len() {
                    return Err(WireError::BadTcpOption { kind, len });
                }
                if kind == KIND {
                    match parse(&area[i..i + len]) {
                        Ok((o, _)) => out.push(o),
                        Err(WireError::UnknownExid(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                i += len;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: Keys = Keys { active: 0x0123_4567_89ab_cdef, passive: 0xfedc_ba98_7654_3210 };

    fn v4() -> Path {
        Path { addr: "10.1.2.3:8080".parse().unwrap(), priority: 5, create: true }
    }

    fn v6() -> Path {
        Path { addr: "[2001:db8::7]:443".parse().unwrap(), priority: 15, create: false }
    }

    #[test]
    fn handshake_options_have_the_seeds_bytes() {
        assert_eq!(conn_id_option(0xdeadbeef), [254, 8, 0x05, 0x89, 0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(key_option(0x1122334455667788), [254, 12, 0x05, 0x8b, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
        assert_eq!(parse(&conn_id_option(7)).unwrap(), (TcpeOption::ConnId(7), 8));
        assert_eq!(parse(&key_option(9)).unwrap(), (TcpeOption::Key(9), 12));
    }

    #[test]
    fn the_seed_path_option_is_the_seeds_twelve_bytes() {
        let o = seed_path_option(&v4()).unwrap();
        assert_eq!(o, [254, 12, 0x05, 0x8a, 10, 1, 2, 3, 0x1f, 0x90, 0x58, 0]);
        assert_eq!(parse(&o).unwrap(), (TcpeOption::SeedPath(v4()), 12));
        assert_eq!(seed_path_option(&v6()), Err(WireError::SeedIpv6));
        let mut bad = o;
        bad[11] = 1;
        assert_eq!(parse(&bad), Err(WireError::Pad(1)));
    }

    #[test]
    fn authenticated_paths_round_trip_and_verify() {
        for (p, len, exid) in [(v4(), PATH4_LEN, 0x058a), (v6(), PATH6_LEN, 0x058c)] {
            let o = path_option(&p, 3, &KEYS, 42, Role::Passive).unwrap();
            assert_eq!(o.len(), len);
            assert_eq!(&o[..4], &[254, len as u8, (exid >> 8) as u8, exid as u8]);
            let (opt, n) = parse(&o).unwrap();
            assert_eq!(n, len);
            let TcpeOption::Path { path, serial, .. } = opt else { panic!("{opt:?}") };
            assert_eq!((path, serial), (p, 3));
            assert!(opt.verify(&KEYS, 42, Role::Passive));
            // Bound to the sender's role, the connection and the keys.
            assert!(!opt.verify(&KEYS, 42, Role::Active));
            assert!(!opt.verify(&KEYS, 43, Role::Passive));
            assert!(!opt.verify(&Keys { active: KEYS.active, passive: 1 }, 42, Role::Passive));
            assert_eq!(opt.to_bytes().unwrap(), o);
            // Every byte after the header is covered: flipping any bit of
            // the address, port, flags, serial or MAC fails verification
            // (or parsing, for the flags' reserved bits).
            for i in 4..len {
                for bit in 0..8 {
                    let mut f = o.clone();
                    f[i] ^= 1 << bit;
                    match parse(&f) {
                        Ok((forged, _)) => assert!(!forged.verify(&KEYS, 42, Role::Passive), "byte {i} bit {bit}"),
                        Err(e) => assert!(matches!(e, WireError::ReservedFlags(_)), "byte {i} bit {bit}: {e}"),
                    }
                }
            }
        }
    }

    #[test]
    fn the_flags_byte_is_priority_and_create() {
        assert_eq!(v4().flags().unwrap(), 0x58);
        assert_eq!(v6().flags().unwrap(), 0xf0);
        let p = Path { priority: 16, ..v4() };
        assert_eq!(p.flags(), Err(WireError::Priority(16)));
        let mut o = path_option(&v4(), 1, &KEYS, 1, Role::Passive).unwrap();
        o[10] |= 0x04;
        assert_eq!(parse(&o), Err(WireError::ReservedFlags(0x5c)));
    }

    #[test]
    fn malformed_options_are_errors() {
        let o = path_option(&v6(), 1, &KEYS, 1, Role::Passive).unwrap();
        // Truncated anywhere.
        for n in 0..o.len() {
            assert!(parse(&o[..n]).is_err(), "{n} bytes");
        }
        // The length byte says more than there is.
        let mut long = o.clone();
        long[1] = 40;
        assert_eq!(parse(&long), Err(WireError::Truncated { need: 40, have: 28 }));
        // Oversized for its ExID, though present.
        let mut big = o.clone();
        big.extend_from_slice(&[0; 4]);
        big[1] = 32;
        assert_eq!(parse(&big), Err(WireError::Length { exid: EXID_PATH6, len: 32 }));
        // Too short for any TCPE option.
        assert_eq!(parse(&[254, 3, 5, 0x89]), Err(WireError::Length { exid: 0, len: 3 }));
        assert_eq!(parse(&[254, 0]), Err(WireError::Length { exid: 0, len: 0 }));
        // Wrong ExID, wrong kind.
        assert_eq!(parse(&[254, 8, 0x05, 0x88, 0, 0, 0, 1]), Err(WireError::UnknownExid(1416)));
        assert_eq!(parse(&[253, 8, 0x05, 0x89, 0, 0, 0, 1]), Err(WireError::NotTcpe(253)));
        // A connection ID of a key's length, and the reverse.
        let mut id = [0u8; 12];
        id[..4].copy_from_slice(&[254, 12, 0x05, 0x89]);
        assert_eq!(parse(&id), Err(WireError::Length { exid: EXID_CONN_ID, len: 12 }));
        assert_eq!(parse(&[254, 8, 0x05, 0x8b, 0, 0, 0, 0]), Err(WireError::Length { exid: EXID_KEY, len: 8 }));
        // A path option of the other family's length.
        let mut mixed = path_option(&v4(), 1, &KEYS, 1, Role::Passive).unwrap();
        mixed[3] = 0x8c;
        assert_eq!(parse(&mixed), Err(WireError::Length { exid: EXID_PATH6, len: 16 }));
    }

    #[test]
    fn an_option_area_is_walked_with_other_options_and_bounded() {
        // A SYN's area as Linux writes it, then the offer.
        let mut area = vec![2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7];
        area.extend_from_slice(&conn_id_option(0xabcd));
        area.extend_from_slice(&key_option(77));
        assert_eq!(options(&area).unwrap(), vec![TcpeOption::ConnId(0xabcd), TcpeOption::Key(77)]);
        // TCP Fast Open's experimental option is someone else's.
        let tfo = [254, 4, 0xf9, 0x89];
        assert_eq!(options(&tfo).unwrap(), vec![]);
        // Padding after the end-of-list byte is not read.
        assert_eq!(options(&[0, 254, 1]).unwrap(), vec![]);
        // An option running past the area, a zero length: errors.
        assert_eq!(options(&[1, 1, 8, 10, 0]), Err(WireError::BadTcpOption { kind: 8, len: 10 }));
        assert_eq!(options(&[5, 0]), Err(WireError::BadTcpOption { kind: 5, len: 0 }));
        assert_eq!(options(&[5]), Err(WireError::BadTcpOption { kind: 5, len: 0 }));
        // A malformed TCPE option inside a well-formed area.
        assert_eq!(options(&[254, 6, 0x05, 0x89, 0, 0]), Err(WireError::Length { exid: EXID_CONN_ID, len: 6 }));
    }

    #[test]
    fn map_paths_convert_both_ways() {
        for p in [v4(), v6()] {
            let c = p.to_c(9).unwrap();
            assert_eq!(Path::from_c(&c).unwrap(), Some((p, 9)));
        }
        assert_eq!(Path::from_c(&Default::default()).unwrap(), None);
        let bad = c::inband_tcpe_path { family: 5, ..Default::default() };
        assert_eq!(Path::from_c(&bad), Err(WireError::Family(5)));
    }
}
