//! Reading back the pcapng files `inband lb capture` writes.

use anyhow::Result;
use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketOption;
use pcap_file::pcapng::{Block, PcapNgReader};

/// The packets a pcapng file holds: (bytes, original length, comment).
pub fn packets(file: &[u8]) -> Result<Vec<(Vec<u8>, u32, String)>> {
    let mut r = PcapNgReader::new(file)?;
    let mut out = Vec::new();
    while let Some(b) = r.next_block() {
        if let Block::EnhancedPacket(p) = b? {
            let comment = p.options.iter().find_map(|o| match o {
                EnhancedPacketOption::Comment(c) => Some(c.to_string()),
                _ => None,
            });
            out.push((p.data.to_vec(), p.original_len, comment.unwrap_or_default()));
        }
    }
    Ok(out)
}
