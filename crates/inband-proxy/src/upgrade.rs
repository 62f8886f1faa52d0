//! What an HTTP/1.1 upgrade is, apart from running its tunnel
//! (tunnel.rs): the outcomes and closes the metrics count, the protocols
//! of an `Upgrade` value, the check of a backend's 101, and the two
//! halves a connection holds until its task runs the tunnel. Nothing here
//! imports the proxy's other modules, so the connection state, the
//! forwarder and the metrics can all use it.

use hyper::upgrade::OnUpgrade;
use http::header::HeaderValue;

/// What became of a request that offered an upgrade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upgrade {
    /// The backend answered 101; the tunnel opens once it is written.
    Switched,
    /// The backend answered something else, forwarded as it came.
    Declined,
    /// No protocol offered is allowed: sent on as a plain request.
    NotAllowed,
    /// No usable answer: the client got a 502, 503 or 504.
    Failed,
}

impl Upgrade {
    pub const ALL: [Upgrade; 4] = [Upgrade::Switched, Upgrade::Declined, Upgrade::NotAllowed, Upgrade::Failed];

    pub fn label(self) -> &'static str {
        match self {
            Upgrade::Switched => "switched",
            Upgrade::Declined => "declined",
            Upgrade::NotAllowed => "not_allowed",
            Upgrade::Failed => "failed",
        }
    }
}

/// Why a tunnel closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Close {
    /// Both sides closed their end.
    Ended,
    /// A side reset or failed (or hyper could not hand a connection over).
    Error,
    /// No byte either way for the idle timeout.
    Idle,
    /// A write waited on a side that does not read for the send timeout.
    Send,
}

impl Close {
    pub const ALL: [Close; 4] = [Close::Ended, Close::Error, Close::Idle, Close::Send];

    pub fn label(self) -> &'static str {
        match self {
            Close::Ended => "ended",
            Close::Error => "error",
            Close::Idle => "idle",
            Close::Send => "send",
        }
    }
}

/// The protocols of an `Upgrade` value, in the client's order of preference.
pub fn protocols(v: &HeaderValue) -> impl Iterator<Item = &str> {
    v.to_str().unwrap_or("").split(',').map(str::trim).filter(|p| !p.is_empty())
}

/// A 101 is good if the protocols it switches to were all offered.
pub fn switched_as_offered(offered: Option<&HeaderValue>, chosen: Option<&HeaderValue>) -> bool {
    let (Some(offered), Some(chosen)) = (offered, chosen) else { return false };
    let mut chosen = protocols(chosen).peekable();
    chosen.peek().is_some() && chosen.all(|c| protocols(offered).any(|o| o.eq_ignore_ascii_case(c)))
}

/// Both halves of a tunnel before hyper has let go of them.
pub struct Pending {
    pub client: OnUpgrade,
    pub backend: OnUpgrade,
    /// The backend's in-flight count for as long as the tunnel lives, held
    /// for its Drop; opaque so that the connection state needs no backend type.
    pub in_flight: Option<Box<dyn Send + Sync>>,
}
