//! Probe points of `inband trace --phases proxy` (docs/trace.md, "Built-in
//! phase sets"; why nop functions: inband-cache's probe.rs).

inband_cache::probe_points!(
    /// A request head has been parsed and the handler starts.
    request_in,
    /// The cache is asked for a stored response.
    cache_lookup,
    /// A request goes to the backends (its retries included).
    origin_fetch,
    /// The response head goes to hyper, which writes it and its body.
    response_out,
);
