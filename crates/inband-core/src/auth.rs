//! The `[auth]` section both `lb.toml` and `agent.toml` share: which option
//! format to use and the shared keys that authenticate 155/124/125
//! (docs/configuration.md, "Authenticated options"), their key files, and
//! writing them into a program's `auth_keys` map.

use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use libbpf_rs::MapCore;
use serde::{Deserialize, Serialize};

use crate::shared as c;
use crate::bpfmap;
use crate::pod::Pod;
use crate::wire::Key;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AuthMode {
    /// Options carry a SipHash-2-4 MAC under a shared key (wire.h).
    #[default]
    Siphash,
    /// The seed's plain options, trusted by source address alone.
    None,
}

impl AuthMode {
    /// The value of `enum inband_auth_mode` the programs read.
    pub fn to_c(self) -> u8 {
        (match self {
            AuthMode::Siphash => c::INBAND_AUTH_SIPHASH,
            AuthMode::None => c::INBAND_AUTH_NONE,
        }) as u8
    }

    /// The mode a program's config holds: the programs treat every value
    /// but INBAND_AUTH_NONE as the authenticated format.
    pub fn from_c(v: u8) -> AuthMode {
        if v == AuthMode::None.to_c() {
            AuthMode::None
        } else {
            AuthMode::Siphash
        }
    }

    /// Its name in `[auth] mode`.
    pub fn name(self) -> &'static str {
        match self {
            AuthMode::Siphash => "siphash",
            AuthMode::None => "none",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRef {
    pub id: u8,
    pub file: PathBuf,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    #[serde(default)]
    pub mode: AuthMode,
    #[serde(default)]
    pub keys: Vec<KeyRef>,
    /// The balancer's signing key (default: the highest id). Agents sign
    /// each 125 with the key of the 124 it answers, so they have no such
    /// setting.
    #[serde(default)]
    pub sign_with: Option<u8>,
}

const HOWTO: &str = "create a key with `inband keygen --out /etc/inband/auth-1.key`, copy it to the balancer and every \
                     agent, and list it in both configs as `[auth]` `keys = [{ id = 1, file = \"/etc/inband/auth-1.key\" }]`; \
                     or set `[auth]` `mode = \"none\"` for the seed's unauthenticated options (docs/configuration.md)";

impl AuthConfig {
    /// Checks that need no files. `balancer`: the config may name `sign_with`.
    pub fn validate(&self, balancer: bool) -> Result<()> {
        let mut ids = HashSet::new();
        for k in &self.keys {
            if k.id == 0 {
                bail!("auth key id 0 is reserved: use 1-255");
            }
            if !ids.insert(k.id) {
                bail!("auth key id {} is listed twice", k.id);
            }
        }
        match self.mode {
            AuthMode::None if !self.keys.is_empty() || self.sign_with.is_some() => {
                bail!("[auth] mode = \"none\" sends unauthenticated options: remove `keys` and `sign_with`, or set mode = \"siphash\"")
            }
            AuthMode::Siphash if self.keys.is_empty() => bail!("no auth key configured: {HOWTO}"),
            _ => {}
        }
        if let Some(s) = self.sign_with {
            if !balancer {
                bail!("[auth] sign_with is a balancer setting: an agent answers with the key of each request");
            }
            if !ids.contains(&s) {
                bail!("[auth] sign_with = {s} names no key in `keys`");
            }
        }
        Ok(())
    }

    /// The id the balancer signs with.
    pub fn signing_key(&self) -> u8 {
        self.sign_with.or_else(|| self.keys.iter().map(|k| k.id).max()).unwrap_or(0)
    }

    /// Reads every key file.
    pub fn load_keys(&self) -> Result<Vec<(u8, Key)>> {
        self.keys.iter().map(|k| Ok((k.id, read_key(&k.file)?))).collect()
    }
}

/// Reads a key file: 32 hex digits (whitespace ignored), as `inband keygen`
/// writes it. Refuses files others may read: the key is the whole trust.
pub fn read_key(path: &Path) -> Result<Key> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading auth key {}: {HOWTO}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        bail!(
            "auth key {} is readable by group or others (mode {:o}): run `chmod 600 {}`",
            path.display(),
            meta.permissions().mode() & 0o777,
            path.display()
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading auth key {}", path.display()))?;
    let hex: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        bail!("auth key {} must hold 32 hex digits (128 bits); `inband keygen --out FILE` makes one", path.display());
    }
    let mut key = [0u8; 16];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    Ok(Key(key))
}

/// Writes a new random key to `path` (mode 0600), refusing to replace one.
pub fn keygen(path: &Path) -> Result<()> {
    let mut key = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .context("reading /dev/urandom")?;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {} (an existing key is never overwritten)", path.display()))?;
    writeln!(f, "{hex}")?;
    Ok(())
}

/// Makes a program's `auth_keys` map hold exactly `keys`, in one batched
/// update.
pub fn write_keys(map: &dyn MapCore, keys: &[(u8, Key)]) -> Result<()> {
    let ids: Vec<u32> = (0..c::INBAND_AUTH_MAX_KEYS).collect();
    let entries: Vec<c::inband_auth_key> = ids
        .iter()
        .map(|&id| {
            keys.iter().find(|(k, _)| u32::from(*k) == id).map_or_else(c::inband_auth_key::default, |(_, key)| {
                let (k0, k1) = key.halves();
                c::inband_auth_key { k0, k1, valid: 1, pad: 0 }
            })
        })
        .collect();
    bpfmap::put_batch(map, &ids, &entries)
}

/// The keys a program's `auth_keys` map holds, as the out-of-band poll
/// protocol uses them (`poll_wire::Keys`): None when `mode` (the
/// program's `auth_mode`) is the unauthenticated one.
pub fn read_keys(mode: u8, map: &dyn MapCore) -> Result<crate::poll_wire::Keys> {
    if u32::from(mode) == c::INBAND_AUTH_NONE {
        return Ok(None);
    }
    // One system call for the whole array, not one per id: the balancer
    // reads the keys for every flow-move request.
    let entries = map
        .lookup_batch(c::INBAND_AUTH_MAX_KEYS, libbpf_rs::MapFlags::ANY, libbpf_rs::MapFlags::ANY)
        .with_context(|| format!("reading map {}", map.name().to_string_lossy()))?;
    let mut keys = Vec::new();
    for (id, value) in entries {
        let id = u32::from_ne_bytes(id[..4].try_into().expect("an array's 4-byte key"));
        keys.extend(valid_key(&c::inband_auth_key::from_bytes(&value)).map(|k| (id as u8, k)));
    }
    Ok(Some(keys))
}

/// Key `id` of a program's `auth_keys`, as `read_keys` would list it (none
/// if that id holds no key): for a message that names its key, one
/// lookup instead of the whole array.
pub fn read_key_by_id(mode: u8, map: &dyn MapCore, id: u8) -> Result<crate::poll_wire::Keys> {
    if u32::from(mode) == c::INBAND_AUTH_NONE {
        return Ok(None);
    }
    let entry: Option<c::inband_auth_key> = bpfmap::get(map, &u32::from(id))?;
    Ok(Some(entry.as_ref().and_then(valid_key).map(|k| (id, k)).into_iter().collect()))
}

fn valid_key(k: &c::inband_auth_key) -> Option<Key> {
    (k.valid != 0).then(|| {
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&k.k0.to_le_bytes());
        key[8..].copy_from_slice(&k.k1.to_le_bytes());
        Key(key)
    })
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_round_trips_through_c_and_is_named_as_in_the_config() {
        for m in [AuthMode::Siphash, AuthMode::None] {
            assert_eq!(AuthMode::from_c(m.to_c()), m);
            assert_eq!(serde_json::to_value(m).unwrap(), m.name());
        }
    }

    fn cfg(text: &str) -> AuthConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn siphash_is_the_default_and_needs_a_key() {
        let e = AuthConfig::default().validate(true).unwrap_err().to_string();
        assert!(e.contains("no auth key configured") && e.contains("inband keygen"), "{e}");
        assert!(cfg("mode = \"none\"").validate(true).is_ok());
    }

    #[test]
    fn refuses_bad_key_lists() {
        let dup = cfg("keys = [{ id = 1, file = \"a\" }, { id = 1, file = \"b\" }]");
        assert!(dup.validate(true).unwrap_err().to_string().contains("listed twice"));
        let zero = cfg("keys = [{ id = 0, file = \"a\" }]");
        assert!(zero.validate(true).unwrap_err().to_string().contains("reserved"));
        let sign = cfg("keys = [{ id = 1, file = \"a\" }]\nsign_with = 2");
        assert!(sign.validate(true).unwrap_err().to_string().contains("names no key"));
        let agent = cfg("keys = [{ id = 1, file = \"a\" }]\nsign_with = 1");
        assert!(agent.validate(false).unwrap_err().to_string().contains("balancer setting"));
        let none = cfg("mode = \"none\"\nkeys = [{ id = 1, file = \"a\" }]");
        assert!(none.validate(true).unwrap_err().to_string().contains("unauthenticated"));
    }

    #[test]
    fn signs_with_the_highest_id_unless_told() {
        assert_eq!(cfg("keys = [{ id = 3, file = \"a\" }, { id = 9, file = \"b\" }]").signing_key(), 9);
        assert_eq!(cfg("keys = [{ id = 3, file = \"a\" }, { id = 9, file = \"b\" }]\nsign_with = 3").signing_key(), 3);
    }

    #[test]
    fn keygen_writes_a_private_key_that_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k");
        keygen(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        let k = read_key(&p).unwrap();
        assert_ne!(k.0, [0; 16]);
        assert!(keygen(&p).is_err(), "an existing key is never overwritten");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_key(&p).unwrap_err().to_string().contains("chmod 600"));
        std::fs::write(dir.path().join("short"), "abcd").unwrap();
        std::fs::set_permissions(dir.path().join("short"), std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_key(&dir.path().join("short")).unwrap_err().to_string().contains("32 hex digits"));
    }
}
