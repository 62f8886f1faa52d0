//! The one way a configuration reaches the balancer's maps: `lb_config`
//! (written only here), the auth keys, the VIP and backend tables
//! (`tables::apply`) and the backends' next hops. The daemon applies its
//! config at start and follows the interface; the control socket applies
//! each change. Every caller holds the daemon's config lock.

use anyhow::{Context, Result};
use tracing::info;

use super::config::LbConfig;
use super::maps::DataPathConfig;
use super::neighbour;
use super::tables::{self, LbMaps};
use inband_core::bpfmap;
use inband_core::pod::be_ip;
use inband_core::wire::Key;

/// All of `cfg` with its key set: at start, and on reload (key rotation:
/// the new keys go in before the signing key that names one of them).
pub fn config_and_keys(maps: &LbMaps, cfg: &LbConfig, keys: &[(u8, Key)]) -> Result<()> {
    inband_core::auth::write_keys(&maps.auth_keys, keys)?;
    config(maps, cfg)
}

/// `cfg` under the keys already written: a run-time change.
pub fn config(maps: &LbMaps, cfg: &LbConfig) -> Result<()> {
    data_path_config(maps, cfg)?;
    let fleet = cfg.scale_out.as_ref().is_some_and(|s| s.fleet().is_some());
    tables::apply(maps, &cfg.vips, cfg.drain_timeout_ms, cfg.maglev_table_size, fleet)?;
    // New backends' next hops now, not at the next periodic pass.
    neighbour::refresh(maps, &cfg.interface)?;
    Ok(())
}

/// Follows the interface: its MTU (no option is added to a packet it would
/// push past it) and the backends' next hops. Returns the next hops still
/// unresolved.
pub fn interface(maps: &LbMaps, interface: &str) -> Result<usize> {
    let mut c: DataPathConfig = bpfmap::get(&maps.lb_config, &0u32)?.unwrap_or_default();
    let mtu = inband_core::netif::mtu(interface)?;
    if c.mtu != mtu {
        info!(interface, old = c.mtu, new = mtu, "interface MTU changed");
        c.mtu = mtu;
        bpfmap::put(&maps.lb_config, &0u32, &c)?;
    }
    neighbour::refresh(maps, interface)
}

/// Writes `lb_config` from `cfg` and the interface's MTU. The SNAT key is
/// made once per data path: a restarted daemon keeps the running one's.
fn data_path_config(maps: &LbMaps, cfg: &LbConfig) -> Result<()> {
    let old: DataPathConfig = bpfmap::get(&maps.lb_config, &0u32)?.unwrap_or_default();
    let snat_key = if old.snat_key != [0, 0] { old.snat_key } else { random_key()? };
    let fleet = match cfg.scale_out.as_ref().and_then(|s| s.fleet()) {
        Some((prefix, key)) => {
            let k = inband_core::auth::read_key(key).context("[scale_out] fleet_key")?;
            Some((prefix, key_words(&k.0)))
        }
        None => None,
    };
    let value = DataPathConfig {
        // A family without an address stays all zero: not served.
        self4: cfg.address.map(|a| be_ip(a.into())).unwrap_or_default(),
        self6: cfg.address6.map(|a| be_ip(a.into())).unwrap_or_default(),
        mtu: inband_core::netif::mtu(&cfg.interface)?,
        auth_mode: cfg.auth.mode.to_c(),
        sign_key: cfg.auth.signing_key(),
        maglev_size: cfg.maglev_table_size,
        snat_key,
        cond_sid: cfg.scale_out.as_ref().map(|s| be_ip(s.sid.into())).unwrap_or_default(),
        direct_sid: cfg.scale_out.as_ref().map(|s| be_ip(s.direct_sid.into())).unwrap_or_default(),
        shadow_sid: cfg.scale_out.as_ref().map(|s| be_ip(s.shadow_sid.into())).unwrap_or_default(),
        snat_pool4: cfg.snat_prefix.map(|p| be_ip(p.network().into())).unwrap_or_default(),
        snat_pool6: cfg.snat_prefix6.map(|p| be_ip(p.network().into())).unwrap_or_default(),
        snat_pool4_n: cfg.snat_prefix.map_or(0, |p| (1u32 << (32 - p.prefix_len())) as u8),
        snat_pool6_n: cfg.snat_prefix6.map_or(0, |p| (1u32 << (128 - p.prefix_len())) as u8),
        fleet_prefix: fleet.map(|(p, _)| be_ip(p.network().into())).unwrap_or_default(),
        fleet_key: fleet.map_or([0, 0], |(_, k)| k),
        adopt_per_s: cfg.scale_out.as_ref().filter(|_| fleet.is_some()).map_or(0, |s| s.adopt_per_s),
        fleet_label: cfg.address6.filter(|_| fleet.is_some()).map_or(0, inband_core::wire::fleet_label),
        ..Default::default()
    };
    bpfmap::put(&maps.lb_config, &0u32, &value)
}

fn random_key() -> Result<[u64; 2]> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .context("reading /dev/urandom")?;
    Ok(key_words(&b))
}

/// A 16-byte key as the data path's SipHash takes it.
fn key_words(b: &[u8; 16]) -> [u64; 2] {
    [u64::from_le_bytes(b[..8].try_into().unwrap()), u64::from_le_bytes(b[8..].try_into().unwrap())]
}
