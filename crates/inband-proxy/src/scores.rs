//! least-score's poller: every `[scores] interval_ms`, asks the agent of
//! every backend of a `least-score` pool for its score, over the agents'
//! signed poll protocol (docs/agent.md "The polling protocol";
//! `inband_core::poll_wire`, the same matching `inband lb` uses), and
//! writes each answer into the backend. One task on the proxy's main
//! runtime for every pool, so a backend listed in several pools is asked
//! once per round. Why polls and not scores carried on the proxy's own
//! backend connections: docs/decisions.md.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use inband_core::poll_wire::{self, Answer, Keys, Refusal};
use tokio::net::UdpSocket;

use crate::backend::Backend;
use crate::config::ScoresConfig;

/// The keys polls are signed and checked with, and the signing key's id,
/// from `[auth]` as `inband lb` reads its own.
pub fn keys(auth: &inband_core::auth::AuthConfig) -> Result<(Keys, u8)> {
    match auth.mode {
        inband_core::auth::AuthMode::None => Ok((None, 0)),
        inband_core::auth::AuthMode::Siphash => Ok((Some(auth.load_keys()?), auth.signing_key())),
    }
}

/// One agent to ask: a backend address and every pool's entry for it.
struct Target {
    addr: SocketAddr,
    backends: Vec<Arc<Backend>>,
    /// The last answer (or the start): the score is stale this long after.
    answered: Instant,
    stale: bool,
}

async fn recv_on(s: Option<&UdpSocket>, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
    match s {
        Some(s) => s.recv_from(buf).await,
        None => std::future::pending().await,
    }
}

/// Polls until the task is aborted (`Proxy::shutdown`). The sockets are
/// bound before it returns, so a proxy that listens is already asking.
pub async fn start(shared: Arc<crate::Shared>, keys: Keys, sign_id: u8) -> Result<tokio::task::JoinHandle<()>> {
    let cfg: ScoresConfig = shared.cfg.raw.scores.clone();
    let backends = scored(&shared.router);
    let mut by_addr: HashMap<SocketAddr, usize> = HashMap::new();
    let mut targets: Vec<Target> = Vec::new();
    let now = Instant::now();
    for b in backends {
        let i = *by_addr.entry(b.addr).or_insert_with(|| {
            targets.push(Target { addr: b.addr, backends: Vec::new(), answered: now, stale: false });
            targets.len() - 1
        });
        targets[i].backends.push(b);
    }
    // Unspecified: the source address is the one routing picks toward the
    // backend, the address the agent must list in `balancers`.
    let v4 = match targets.iter().any(|t| t.addr.is_ipv4()) {
        true => Some(UdpSocket::bind("0.0.0.0:0").await.context("opening the score poll socket")?),
        false => None,
    };
    let v6 = match targets.iter().any(|t| t.addr.is_ipv6()) {
        true => Some(UdpSocket::bind("[::]:0").await.context("opening the IPv6 score poll socket")?),
        false => None,
    };
    // Checked once here, so the loop's rounds cannot fail on it.
    poll_wire::Round::<usize>::new(keys.clone(), sign_id).map_err(anyhow::Error::msg)?;
    Ok(tokio::spawn(async move {
        let mut told_unauthenticated = false;
        loop {
            let start = Instant::now();
            let deadline = tokio::time::Instant::from_std(start + cfg.interval());
            let mut round = poll_wire::Round::new(keys.clone(), sign_id).expect("checked before the first round");
            for (i, t) in targets.iter().enumerate() {
                let to = SocketAddr::new(t.addr.ip(), cfg.poll_port);
                let req = round.ask(t.addr, cfg.poll_port, i, rand::random());
                let sock = if to.is_ipv4() { v4.as_ref() } else { v6.as_ref() };
                let sent = sock.expect("a socket per family with backends").send_to(&req, to).await;
                if let Err(e) = sent {
                    round.forget(t.addr, cfg.poll_port);
                    shared.metrics.score_poll(&t.backends, "send_failed");
                    tracing::debug!(backend = %t.addr, error = %e, "sending a score poll failed");
                }
            }
            let (mut b4, mut b6) = ([0u8; poll_wire::MAX_LEN], [0u8; poll_wire::MAX_LEN]);
            while round.waiting() > 0 {
                let got = tokio::time::timeout_at(deadline, async {
                    tokio::select! {
                        r = recv_on(v4.as_ref(), &mut b4) => r.map(|(n, from)| (b4[..n].to_vec(), from)),
                        r = recv_on(v6.as_ref(), &mut b6) => r.map(|(n, from)| (b6[..n].to_vec(), from)),
                    }
                })
                .await;
                let (buf, from) = match got {
                    Err(_) => break,
                    // Not expected on an unconnected socket; ending the
                    // round (its targets unanswered) rather than retrying
                    // keeps an error that repeats from spinning.
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "receiving score poll replies failed");
                        break;
                    }
                    Ok(Ok((buf, from))) => (buf, inband_core::net::unmapped(from)),
                };
                match round.answer(from, &buf) {
                    Answer::Score(i, score) => {
                        let t = &mut targets[i];
                        let now = Instant::now();
                        for b in &t.backends {
                            b.set_score(score, now, cfg.valid_for());
                        }
                        shared.metrics.score_poll(&t.backends, "answered");
                        t.answered = now;
                        if t.stale {
                            t.stale = false;
                            tracing::info!(backend = %t.addr, "its agent answers score polls again: ranked by its score");
                        }
                    }
                    Answer::Stale | Answer::Refused(Refusal::NotOurs) => {}
                    Answer::Refused(why) => {
                        shared.metrics.score_reply_unauthenticated();
                        if !told_unauthenticated {
                            told_unauthenticated = true;
                            tracing::warn!(%from, ?why, "score poll reply that does not authenticate: ignored (do the proxy's and the agent's [auth] match?); counted in score_replies_unauthenticated");
                        }
                    }
                }
            }
            for ((_, _), i) in round.unanswered() {
                shared.metrics.score_poll(&targets[i].backends, "unanswered");
            }
            // Every target, those whose requests could not be sent too.
            let now = Instant::now();
            for t in targets.iter_mut().filter(|t| !t.stale && now.duration_since(t.answered) >= cfg.valid_for()) {
                t.stale = true;
                shared.metrics.score_stale(&t.backends);
                tracing::warn!(
                    backend = %t.addr,
                    poll_port = cfg.poll_port,
                    rounds = cfg.stale_after,
                    "no score from the backend's agent: ranked by this proxy's requests in flight alone until it answers. \
                     Is this proxy's address in the agent's `balancers`, and are the [auth] keys the same? \
                     (the agent counts refused polls in polls_refused and polls_unauthenticated)"
                );
            }
            tokio::time::sleep_until(deadline).await;
        }
    }))
}

/// Every backend of a `least-score` pool.
pub fn scored(router: &crate::routes::Router) -> Vec<Arc<Backend>> {
    router.all().filter(|r| r.pool.policy.kind() == crate::config::PolicyKind::LeastScore).flat_map(|r| r.pool.backends.iter().cloned()).collect()
}
