//! The data path's settings besides services and balancers: the option
//! format, the keys (`[auth]`) and the interface MTU, held in the maps
//! `agent_config` and `auth_keys`. Written at start, rewritten without
//! detaching on SIGHUP (key rotation, a change of format) and when the MTU
//! of the interface changes.

use anyhow::{Context, Result};

use super::config::AgentConfig;
use super::maps::DataPathConfig;
use super::tables::{AgentMaps, AuthStatus};
use inband_core::auth::{self, AuthMode};
use inband_core::bpfmap;
use inband_core::wire::Key;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataPathSettings {
    pub mode: AuthMode,
    /// Sorted by id.
    pub keys: Vec<(u8, Key)>,
    /// What the egress program may grow a packet to with a 125.
    pub mtu: u16,
    /// A UDP client tuple unused this long is forgotten.
    pub udp_idle_timeout_s: u32,
}

impl DataPathSettings {
    pub fn new(mode: AuthMode, mut keys: Vec<(u8, Key)>, mtu: u16, udp_idle_timeout_s: u32) -> DataPathSettings {
        keys.sort_by_key(|(id, _)| *id);
        DataPathSettings { mode, keys, mtu, udp_idle_timeout_s }
    }

    /// Writes what differs from `previous` (everything without one). Keys
    /// go first, so a switch to the authenticated format finds them.
    pub fn apply(&self, maps: &AgentMaps, previous: Option<&DataPathSettings>) -> Result<()> {
        if previous.is_none_or(|p| p.keys != self.keys) {
            auth::write_keys(&maps.auth_keys, &self.keys).context("writing auth_keys")?;
        }
        if previous.is_none_or(|p| p.mode != self.mode || p.mtu != self.mtu || p.udp_idle_timeout_s != self.udp_idle_timeout_s) {
            let value = DataPathConfig {
                auth_mode: self.mode.to_c(),
                mtu: self.mtu,
                udp_idle_timeout_s: self.udp_idle_timeout_s,
                ..Default::default()
            };
            bpfmap::put(&maps.agent_config, &0u32, &value)?;
        }
        Ok(())
    }

    /// What changed from `self` to `new`, one phrase per change, for the log.
    pub fn changes(&self, new: &DataPathSettings) -> Vec<String> {
        let mut out = Vec::new();
        if self.mode != new.mode {
            out.push(format!("auth mode {} -> {}", self.mode.name(), new.mode.name()));
        }
        let old_ids: Vec<u8> = self.keys.iter().map(|(id, _)| *id).collect();
        let new_ids: Vec<u8> = new.keys.iter().map(|(id, _)| *id).collect();
        let added: Vec<u8> = new_ids.iter().copied().filter(|id| !old_ids.contains(id)).collect();
        let removed: Vec<u8> = old_ids.iter().copied().filter(|id| !new_ids.contains(id)).collect();
        let replaced: Vec<u8> = new
            .keys
            .iter()
            .filter(|(id, key)| self.keys.iter().any(|(old, k)| old == id && k != key))
            .map(|(id, _)| *id)
            .collect();
        for (what, ids) in [("added", added), ("removed", removed), ("replaced", replaced)] {
            if !ids.is_empty() {
                out.push(format!("key ids {what}: {}", id_list(&ids)));
            }
        }
        if self.mtu != new.mtu {
            out.push(format!("mtu {} -> {}", self.mtu, new.mtu));
        }
        out
    }

    pub fn status(&self) -> AuthStatus {
        AuthStatus { mode: self.mode, key_ids: self.keys.iter().map(|(id, _)| *id).collect() }
    }
}

fn id_list(ids: &[u8]) -> String {
    ids.iter().map(|id| id.to_string()).collect::<Vec<_>>().join(", ")
}

/// Top-level settings of `agent.toml` other than `[auth]` that differ
/// between `old` and `new`: SIGHUP does not apply them.
pub fn restart_only_changes(old: &AgentConfig, new: &AgentConfig) -> Result<Vec<String>> {
    let (serde_json::Value::Object(mut a), serde_json::Value::Object(mut b)) =
        (serde_json::to_value(old)?, serde_json::to_value(new)?)
    else {
        anyhow::bail!("an agent config is a table");
    };
    a.remove("auth");
    b.remove("auth");
    let mut keys: Vec<String> = a.keys().chain(b.keys()).cloned().collect();
    keys.sort();
    keys.dedup();
    Ok(keys.into_iter().filter(|k| a.get(k) != b.get(k)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(mode: AuthMode, keys: &[(u8, u8)], mtu: u16) -> DataPathSettings {
        DataPathSettings { mode, keys: keys.iter().map(|(id, b)| (*id, Key([*b; 16]))).collect(), mtu, udp_idle_timeout_s: 110 }
    }

    #[test]
    fn changes_name_ids_never_keys() {
        let old = settings(AuthMode::Siphash, &[(1, 0xaa), (2, 0xbb)], 1500);
        assert!(old.changes(&old).is_empty());
        let new = settings(AuthMode::Siphash, &[(2, 0xcc), (3, 0xdd)], 9000);
        assert_eq!(
            old.changes(&new),
            ["key ids added: 3", "key ids removed: 1", "key ids replaced: 2", "mtu 1500 -> 9000"]
        );
        let none = settings(AuthMode::None, &[], 1500);
        assert_eq!(old.changes(&none), ["auth mode siphash -> none", "key ids removed: 1, 2"]);
        assert!(old.changes(&new).iter().all(|c| !c.contains("aa") && !c.contains("cc")));
    }

    #[test]
    fn restart_only_changes_ignore_auth() {
        let base = "interface = \"eth0\"\nbalancers = [\"10.0.0.1\"]\n[[service]]\nport = 80\nvip = \"10.0.0.9:80\"\n";
        let a = AgentConfig::parse(&format!("{base}[auth]\nmode = \"none\"\n")).unwrap();
        let b = AgentConfig::parse(&format!(
            "{}[auth]\nkeys = [{{ id = 1, file = \"/k\" }}]\n",
            base.replace("10.0.0.1", "10.0.0.2").replace("eth0\"", "eth0\"\npoll_port = 0")
        ))
        .unwrap();
        assert!(restart_only_changes(&a, &a).unwrap().is_empty());
        assert_eq!(restart_only_changes(&a, &b).unwrap(), ["balancers", "poll_port"]);
    }
}
