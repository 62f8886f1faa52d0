//! Writing weights to a balancer: inband's control socket or HAProxy's
//! runtime API. Both take integers; the controller's weights are
//! fractions summing to 1.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::config::{BackendConfig, Target};
use inband_core::lb_control::{ControlReply, ControlRequest};

/// inband weights are relative (0-65535): 10,000 for the whole VIP keeps
/// a 0.01% resolution.
const INBAND_SCALE: f64 = 10_000.0;
/// HAProxy's largest weight.
const HAPROXY_MAX: f64 = 256.0;

/// The integers written for `weights`: a backend with any weight gets at
/// least 1 (0 means "no new connections" to both balancers).
pub fn integers(weights: &[f64], target: &Target) -> Vec<u32> {
    let scale = match target {
        Target::Inband { .. } => INBAND_SCALE,
        Target::Haproxy { .. } => HAPROXY_MAX / weights.iter().copied().fold(f64::MIN_POSITIVE, f64::max),
    };
    weights.iter().map(|&w| if w > 0.0 { ((w * scale).round() as u32).max(1) } else { 0 }).collect()
}

pub fn write(target: &Target, backends: &[BackendConfig], weights: &[f64]) -> Result<Vec<u32>> {
    let ints = integers(weights, target);
    match target {
        Target::Inband { socket, vip, protocol } => {
            let req = ControlRequest::SetWeights {
                vip: *vip,
                protocol: *protocol,
                weights: backends.iter().zip(&ints).map(|(b, &w)| (b.address, w)).collect(),
            };
            let reply: ControlReply = inband_core::lb_control::send(socket, &req)?;
            if !reply.ok {
                bail!("the balancer refused the weights: {}", reply.message);
            }
        }
        Target::Haproxy { socket, backend } => {
            // One connection, the commands separated by ';' (the runtime
            // API's non-interactive mode answers each, then closes).
            let line: Vec<String> = backends
                .iter()
                .zip(&ints)
                .map(|(b, w)| format!("set weight {backend}/{} {w}", b.name.as_deref().unwrap_or_default()))
                .collect();
            let mut s = UnixStream::connect(socket)
                .with_context(|| format!("connecting to HAProxy's admin socket {}", socket.display()))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            writeln!(s, "{}", line.join(";"))?;
            let mut answer = String::new();
            s.read_to_string(&mut answer).context("reading HAProxy's answer")?;
            // `set weight` answers nothing on success, a sentence otherwise.
            let complaints: Vec<&str> = answer.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            if !complaints.is_empty() {
                bail!("HAProxy refused `{}`: {}", line.join(";"), complaints.join(" / "));
            }
        }
    }
    Ok(ints)
}

/// The weights HAProxy has now, by server name (`show servers state`), for
/// tests and the benchmark's check that the API took them.
pub fn haproxy_weights(socket: &std::path::Path, backend: &str) -> Result<Vec<(String, u32)>> {
    let mut s = UnixStream::connect(socket).with_context(|| format!("connecting to {}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    writeln!(s, "show servers state {backend}")?;
    let mut out = Vec::new();
    // Columns: be_id be_name srv_id srv_name srv_addr srv_op_state
    // srv_admin_state srv_uweight srv_iweight ...
    for line in BufReader::new(s).lines() {
        let line = line?;
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() > 8 && !line.starts_with('#') && f[1] == backend {
            out.push((f[3].to_string(), f[7].parse().unwrap_or(0)));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_keep_the_ratios_and_never_round_a_used_backend_to_zero() {
        let inband = Target::Inband { socket: "/x".into(), vip: "10.0.0.1:80".parse().unwrap(), protocol: Default::default() };
        assert_eq!(integers(&[0.06, 0.13, 0.27, 0.54, 0.0], &inband), vec![600, 1300, 2700, 5400, 0]);
        assert_eq!(integers(&[0.00001, 0.99999], &inband), vec![1, 10000]);
        let haproxy = Target::Haproxy { socket: "/x".into(), backend: "b".into() };
        assert_eq!(integers(&[0.1, 0.2, 0.7, 0.0], &haproxy), vec![37, 73, 256, 0]);
    }
}
