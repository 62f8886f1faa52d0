//! A private instance of the balancer program: loaded with nothing pinned
//! (so it never shares a running balancer's maps) and attached nowhere, for
//! packet fixtures and `inband bench dataplane`, which feed it frames
//! through BPF_PROG_TEST_RUN and set its maps directly.

use std::mem::MaybeUninit;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{libbpf_sys, AsRawLibbpf, Map, MapHandle, OpenObject, ProgramInput};

use super::maps::*;
use super::tables::LbMaps;
use crate::bpf::balancer::{BalancerSkel, BalancerSkelBuilder};
use inband_core::bpfmap::{get, put};

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;

pub struct PrivateBalancer<'obj> {
    pub skel: BalancerSkel<'obj>,
}

/// What one run of a frame did.
pub struct Run {
    pub verdict: u32,
    pub frame: Vec<u8>,
    /// The kernel's own timing of the run.
    pub ns: f64,
}

impl<'obj> PrivateBalancer<'obj> {
    /// Loads the program with `flow_table_size` flows (the other tables
    /// sized from it as `inband lb` sizes them) and `config` in lb_config.
    pub fn load(storage: &'obj mut MaybeUninit<OpenObject>, flow_table_size: u32, config: &DataPathConfig) -> Result<Self> {
        let mut open = BalancerSkelBuilder::default().open(storage).context("opening the balancer BPF object")?;
        let sizes = super::attach::table_sizes(flow_table_size, config.maglev_size, MAGLEV_DEFAULT_TABLES);
        for mut map in open.open_object_mut().maps_mut() {
            // LIBBPF_PIN_BY_NAME would pin under /sys/fs/bpf (and reuse what
            // a running balancer pinned there).
            // SAFETY: a NULL path clears the pin path of a valid map.
            unsafe { libbpf_sys::bpf_map__set_pin_path(map.as_libbpf_object().as_ptr(), std::ptr::null()) };
            let name = map.name().to_string_lossy().into_owned();
            if let Some((_, n)) = sizes.iter().find(|(m, _)| *m == name) {
                map.set_max_entries(*n)?;
            }
        }
        let skel = open.load().context("loading the balancer program (verifier)")?;
        put(&skel.maps.lb_config, &0u32, config)?;
        Ok(PrivateBalancer { skel })
    }

    /// Returns every map to its state just after `load` with `config`.
    /// Packet fixtures reuse one loaded instance this way: the verifier is
    /// nearly all of a load's cost (about 0.4 CPU-s), a reset a few ms.
    pub fn reset(&self, config: &DataPathConfig) -> Result<()> {
        inband_core::bpfmap::reset_maps(self.skel.object())?;
        put(&self.skel.maps.lb_config, &0u32, config)
    }

    pub fn set_backend(&self, id: u32, b: &Backend) -> Result<()> {
        put(&self.skel.maps.backends, &id, b)
    }

    /// VIP `id` at `key` with its config (address and port taken from the
    /// key) and its backends' ids in slot order; its eligible set from the
    /// backends' flags as they are now.
    pub fn set_vip(&self, id: u32, key: VipKey, vip: &Vip, slots: &[u32]) -> Result<()> {
        let maps = self.maps()?;
        super::tables::write_slots(&maps, id, slots)?;
        let eligible_count = super::tables::write_eligible(&maps, id, slots)?;
        let v = Vip { addr: key.addr, port: key.port, backend_count: slots.len() as u16, eligible_count, ..*vip };
        put(&self.skel.maps.vip_conf, &id, &v)?;
        put(&self.skel.maps.vips, &key, &id)
    }

    /// Handles on its maps like those the daemon holds on a pinned
    /// balancer's: the control plane's writers and readers (tables::apply,
    /// snapshot::take) run on it.
    pub fn maps(&self) -> Result<LbMaps> {
        let h = |m: &Map| MapHandle::try_from(m).context("duplicating a map's fd");
        let m = &self.skel.maps;
        Ok(LbMaps {
            lb_config: h(&m.lb_config)?,
            auth_keys: h(&m.auth_keys)?,
            vips: h(&m.vips)?,
            vip_conf: h(&m.vip_conf)?,
            backends: h(&m.backends)?,
            vip_backends: h(&m.vip_backends)?,
            vip_eligible: h(&m.vip_eligible)?,
            scores: h(&m.scores)?,
            probe_due: h(&m.probe_due)?,
            rr_cursor: h(&m.rr_cursor)?,
            flows: h(&m.flows)?,
            half_open: h(&m.half_open)?,
            half_open_ports: h(&m.half_open_ports)?,
            snat: h(&m.snat)?,
            backend_stats: h(&m.backend_stats)?,
            vip_stats: h(&m.vip_stats)?,
            drops: h(&m.drops)?,
            events: h(&m.events)?,
            gauges: h(&m.gauges)?,
            sweep_stats: h(&m.sweep_stats)?,
            control_stats: h(&m.control_stats)?,
            backend_health: h(&m.backend_health)?,
            maglev: h(&m.maglev)?,
            query_ring: h(&m.query_ring)?,
            query_done: h(&m.query_done)?,
            choice_ring: h(&m.choice_ring)?,
            peer_choices: h(&m.peer_choices)?,
        })
    }

    pub fn vip(&self, id: u32) -> Result<Vip> {
        Ok(get(&self.skel.maps.vip_conf, &id)?.unwrap_or_default())
    }

    /// One run of `frame`.
    pub fn run(&self, frame: &[u8]) -> Result<Run> {
        let mut out = vec![0u8; frame.len() + 256];
        let input = ProgramInput { data_in: Some(frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
        let o = self.skel.progs.balancer.test_run(input).context("BPF_PROG_TEST_RUN")?;
        let verdict = o.return_value;
        let ns = o.duration.as_nanos() as f64;
        let n = o.data.map_or(0, |d| d.len());
        out.truncate(n);
        Ok(Run { verdict, frame: out, ns })
    }

    /// One pass of the sweeper as if the time were `now` (0 = now).
    pub fn sweep(&self, now: u64) -> Result<()> {
        super::sweep::run(&self.skel.progs.sweep, now)
    }

    pub fn drops(&self) -> Result<Vec<u64>> {
        super::tables::counters(&self.skel.maps.drops, DROP_NAMES.len())
    }

    pub fn events(&self) -> Result<Vec<u64>> {
        super::tables::counters(&self.skel.maps.events, EVENT_NAMES.len())
    }

    pub fn backend_stats(&self, id: u32) -> Result<BackendStats> {
        super::tables::sum_percpu(&self.skel.maps.backend_stats, id)
    }

    pub fn vip_stats(&self, id: u32) -> Result<VipStats> {
        super::tables::sum_percpu(&self.skel.maps.vip_stats, id)
    }
}
