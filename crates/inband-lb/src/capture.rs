//! `inband lb capture`: a sample of the packets the balancer drops, with
//! the reason of each, in a pcapng file that tcpdump and Wireshark read
//! (Katran's pcap introspection). The data path writes records only while
//! this command's lease in `capture_conf` runs (lb/capture.h), so a
//! capture killed without clean-up stops within LEASE.

use std::borrow::Cow;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use libbpf_rs::MapHandle;
use pcap_file::pcapng::blocks::enhanced_packet::{EnhancedPacketBlock, EnhancedPacketOption};
use pcap_file::pcapng::blocks::interface_description::{InterfaceDescriptionBlock, InterfaceDescriptionOption};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::DataLink;

use super::attach;
use super::maps::{drop_name, CaptureConf, CaptureRec, CaptureState};
use super::tables::ktime_ns;
use inband_core::bpfmap::{self, PinDir};
use inband_core::pod::Pod;
use inband_core::shared as c;

/// How long the data path keeps capturing without hearing from us.
const LEASE: Duration = Duration::from_secs(2);
const RENEW_EVERY: Duration = Duration::from_millis(500);
pub const SNAPLEN: u32 = c::INBAND_CAPTURE_SNAPLEN;
pub const RATE_MAX: u32 = 100_000;

#[derive(clap::Args, Debug)]
pub struct CaptureArgs {
    /// The interface the balancer is attached to.
    #[arg(long)]
    pub interface: String,
    /// The pcapng file to write (replaced if it exists).
    #[arg(long)]
    pub out: PathBuf,
    /// Stop after this many packets.
    #[arg(long, default_value_t = 1000)]
    pub count: u64,
    /// Stop after this many seconds (default: at --count, or SIGINT/SIGTERM).
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Packets a second per CPU at most, 1-100000: drops beyond it are
    /// counted, not captured.
    #[arg(long, default_value_t = 100)]
    pub rate: u32,
}

/// The capture's three maps: its switch, its per-CPU counters, its ring.
pub struct CaptureMaps {
    pub conf: MapHandle,
    pub state: MapHandle,
    pub ring: MapHandle,
}

impl CaptureMaps {
    pub fn open(dir: &PinDir) -> Result<CaptureMaps> {
        let open = |name| {
            dir.open(name).context("this balancer's data path has no capture: it was loaded by an older inband (restart `inband lb`)")
        };
        Ok(CaptureMaps { conf: open("capture_conf")?, state: open("capture_state")?, ring: open("capture_ring")? })
    }

    /// Every CPU's counters, summed.
    pub fn counters(&self) -> Result<CaptureState> {
        let mut t = CaptureState::default();
        for s in bpfmap::get_percpu::<u32, CaptureState>(&self.state, &0)? {
            t.captured += s.captured;
            t.limited += s.limited;
            t.lost += s.lost;
        }
        Ok(t)
    }

    fn lease(&self, per_second: u32) -> Result<()> {
        let until_ns = if per_second == 0 { 0 } else { ktime_ns() + LEASE.as_nanos() as u64 };
        bpfmap::put(&self.conf, &0u32, &CaptureConf { until_ns, per_second, pad: 0 })
    }
}

/// Turns the capture on for as long as it lives, and off when dropped
/// (an error, a full disk and a signal included).
pub struct Lease<'a> {
    maps: &'a CaptureMaps,
    per_second: u32,
    renewed: Instant,
}

impl<'a> Lease<'a> {
    /// Refuses while another capture's lease runs: two readers of one ring
    /// would each get part of it.
    pub fn take(maps: &'a CaptureMaps, per_second: u32) -> Result<Lease<'a>> {
        if !(1..=RATE_MAX).contains(&per_second) {
            bail!("--rate {per_second} is out of range 1-{RATE_MAX}");
        }
        let now: CaptureConf = bpfmap::get(&maps.conf, &0u32)?.unwrap_or_default();
        if now.per_second != 0 && now.until_ns > ktime_ns() {
            bail!("another capture is running on this balancer (or ended without clean-up less than {LEASE:?} ago): try again");
        }
        maps.lease(per_second)?;
        Ok(Lease { maps, per_second, renewed: Instant::now() })
    }

    pub fn renew(&mut self) -> Result<()> {
        if self.renewed.elapsed() >= RENEW_EVERY {
            self.maps.lease(self.per_second)?;
            self.renewed = Instant::now();
        }
        Ok(())
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let _ = self.maps.lease(0);
    }
}

/// pcapng out: one Ethernet interface, each packet with its drop reason
/// as the comment.
pub struct PcapOut<W: Write> {
    w: PcapNgWriter<W>,
    /// CLOCK_REALTIME - CLOCK_MONOTONIC, to date the records.
    wall_offset_ns: i128,
}

impl<W: Write> PcapOut<W> {
    pub fn new(out: W, interface: &str) -> Result<PcapOut<W>> {
        let mut w = PcapNgWriter::new(out)?;
        w.write_pcapng_block(InterfaceDescriptionBlock {
            linktype: DataLink::ETHERNET,
            snaplen: SNAPLEN,
            // pcap-file writes timestamps in nanoseconds whatever the
            // block says: the block must say so (the default is µs).
            options: vec![InterfaceDescriptionOption::IfName(Cow::Owned(interface.to_string())), InterfaceDescriptionOption::IfTsResol(9)],
        })?;
        let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos() as i128;
        Ok(PcapOut { w, wall_offset_ns: wall - i128::from(ktime_ns()) })
    }

    pub fn write(&mut self, r: &CaptureRec) -> Result<()> {
        let caplen = (r.caplen as usize).min(r.data.len());
        let ts = u64::try_from(i128::from(r.ts_ns) + self.wall_offset_ns).unwrap_or(0);
        self.w.write_pcapng_block(EnhancedPacketBlock {
            interface_id: 0,
            timestamp: Duration::from_nanos(ts),
            original_len: r.len,
            data: Cow::Borrowed(&r.data[..caplen]),
            options: vec![EnhancedPacketOption::Comment(Cow::Owned(format!("drop: {}", drop_name(r.reason))))],
        })?;
        Ok(())
    }

    pub fn finish(self) -> Result<W> {
        let mut inner = self.w.into_inner();
        inner.flush()?;
        Ok(inner)
    }
}

/// Reads the ring until `stop`, `count` records or `seconds`, writing each
/// record to `out`; the records written.
pub fn record<W: Write>(maps: &CaptureMaps, lease: &mut Lease, out: &mut PcapOut<W>, count: u64, seconds: Option<u64>, stop: &AtomicBool) -> Result<u64> {
    let got: Arc<Mutex<Vec<CaptureRec>>> = Arc::default();
    let sink = Arc::clone(&got);
    let mut builder = libbpf_rs::RingBufferBuilder::new();
    builder
        .add(&maps.ring, move |d: &[u8]| {
            sink.lock().unwrap().push(CaptureRec::from_bytes(d));
            0
        })
        .context("reading capture_ring")?;
    let ring = builder.build().context("reading capture_ring")?;
    let deadline = seconds.map(|s| Instant::now() + Duration::from_secs(s));
    let mut written = 0;
    while written < count && !stop.load(Ordering::Relaxed) && deadline.is_none_or(|d| Instant::now() < d) {
        ring.poll(Duration::from_millis(100)).context("polling capture_ring")?;
        lease.renew()?;
        for r in std::mem::take(&mut *got.lock().unwrap()) {
            if written == count {
                break;
            }
            out.write(&r)?;
            written += 1;
        }
    }
    Ok(written)
}

pub fn run(args: &CaptureArgs) -> Result<()> {
    let dir = attach::pin_dir(&args.interface);
    if !dir.exists() {
        bail!("no balancer is attached to {}: nothing is pinned at {}", args.interface, dir.0.display());
    }
    let maps = CaptureMaps::open(&dir)?;
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    let file = std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut out = PcapOut::new(std::io::BufWriter::new(file), &args.interface).with_context(|| writing(&args.out))?;
    let before = maps.counters()?;
    let mut lease = Lease::take(&maps, args.rate)?;
    let written = record(&maps, &mut lease, &mut out, args.count, args.seconds, &stop).with_context(|| writing(&args.out))?;
    drop(lease);
    out.finish().with_context(|| writing(&args.out))?;
    let after = maps.counters()?;
    println!(
        "{written} dropped packets written to {}; not captured: {} over --rate {}/s per CPU, {} when the ring was full",
        args.out.display(),
        after.limited - before.limited,
        args.rate,
        after.lost - before.lost
    );
    Ok(())
}

fn writing(p: &Path) -> String {
    format!("writing {}", p.display())
}
