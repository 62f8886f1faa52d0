//! Weighted Maglev lookup tables (Eisenbud et al., NSDI '16, §3.4): for
//! each VIP a table of `size` entries (a prime), each a slot of the VIP,
//! which the data path indexes by a hash of the client side (select.h,
//! `select_backend`). Every backend has its own permutation of the entries,
//! from two hashes of its address and port; backends take turns claiming
//! the next free entry of their permutation until the table is full. A
//! backend change moves few entries: a removed backend's entries go to the
//! others, and the rest mostly stay where they were. Weights: a backend
//! claims `weight / max weight` entries per turn (with the remainder
//! carried), so its share of the table is its share of the weights — the
//! paper's weighted variant; weight 0 claims none.
//!
//! Written by hand: no maintained crate builds Maglev tables (the
//! `maglev` crate's last release is from 2019 and is unweighted), and the
//! table must be bit-for-bit what every balancer instance computes from
//! the same configuration.

use siphasher::sip::SipHasher24;
use std::hash::Hasher;

use inband_core::shared as c;

pub const DEFAULT_SIZE: u32 = c::INBAND_MAGLEV_DEFAULT_SIZE;

/// The data path's hash of a flow key (its 40 bytes): the index into a
/// table of `size` entries is `flow_hash(key) % size`.
pub fn flow_hash(key_bytes: &[u8]) -> u64 {
    let mut h = SipHasher24::new_with_keys(c::INBAND_MAGLEV_K0, c::INBAND_MAGLEV_K1);
    h.write(key_bytes);
    h.finish()
}

/// (offset, skip) of a backend's permutation, from its name (address and
/// port): the same on every balancer.
fn permutation(name: &str, size: u64) -> (u64, u64) {
    let hash = |seed: u64| {
        let mut h = SipHasher24::new_with_keys(c::INBAND_MAGLEV_K0 ^ seed, c::INBAND_MAGLEV_K1);
        h.write(name.as_bytes());
        h.finish()
    };
    (hash(1) % size, hash(2) % (size - 1) + 1)
}

/// The table for `backends` (name, weight), in slot order: entry i is the
/// slot (index into `backends`) that connections hashing to i go to. Empty
/// if no backend has a weight.
pub fn table(backends: &[(String, u32)], size: u32) -> Vec<u32> {
    let n = size as u64;
    let max_weight = backends.iter().map(|(_, w)| *w).max().unwrap_or(0);
    if max_weight == 0 {
        return Vec::new();
    }
    let perms: Vec<(u64, u64)> = backends.iter().map(|(name, _)| permutation(name, n)).collect();
    let mut next = vec![0u64; backends.len()];
    let mut credit = vec![0u64; backends.len()];
    let mut entries = vec![u32::MAX; size as usize];
    let mut filled = 0u64;
    while filled < n {
        for (slot, (_, weight)) in backends.iter().enumerate() {
            credit[slot] += u64::from(*weight);
            while credit[slot] >= u64::from(max_weight) && filled < n {
                credit[slot] -= u64::from(max_weight);
                let (offset, skip) = perms[slot];
                // The next entry of this backend's permutation that is free.
                let mut e = (offset + next[slot] * skip) % n;
                while entries[e as usize] != u32::MAX {
                    next[slot] += 1;
                    e = (offset + next[slot] * skip) % n;
                }
                entries[e as usize] = slot as u32;
                next[slot] += 1;
                filled += 1;
            }
        }
    }
    entries
}

/// Whether `n` is a prime (table sizes must be: each permutation then
/// visits every entry).
pub fn is_prime(n: u32) -> bool {
    n >= 2 && (2..).take_while(|d: &u32| u64::from(*d) * u64::from(*d) <= u64::from(n)).all(|d| n % d != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(weights: &[u32]) -> Vec<(String, u32)> {
        weights.iter().enumerate().map(|(i, w)| (format!("10.0.0.{}:8080", i + 1), *w)).collect()
    }

    fn shares(t: &[u32], n: usize) -> Vec<usize> {
        (0..n as u32).map(|s| t.iter().filter(|e| **e == s).count()).collect()
    }

    #[test]
    fn every_entry_is_a_backend_and_shares_follow_the_weights() {
        let t = table(&named(&[1, 1, 1, 1]), DEFAULT_SIZE);
        assert_eq!(t.len(), DEFAULT_SIZE as usize);
        for s in shares(&t, 4) {
            assert!((s as f64 - 65537.0 / 4.0).abs() < 65537.0 * 0.01, "{s}");
        }
        let t = table(&named(&[1, 2, 4, 0]), DEFAULT_SIZE);
        let got = shares(&t, 4);
        assert_eq!(got[3], 0, "weight 0 takes nothing");
        for (s, w) in got.iter().zip([1.0, 2.0, 4.0]) {
            assert!((*s as f64 - 65537.0 * w / 7.0).abs() < 65537.0 * 0.01, "{got:?}");
        }
        assert!(table(&named(&[0, 0]), DEFAULT_SIZE).is_empty());
    }

    #[test]
    fn a_backend_change_moves_few_other_entries() {
        // The paper's property, M >> 100 N: beyond the entries of the
        // backend removed (or added), under 1% of the table changes owner
        // (0.16% here).
        let moved = |before: &[(String, u32)], after: &[(String, u32)], changed: &str| {
            let (t0, t1) = (table(before, DEFAULT_SIZE), table(after, DEFAULT_SIZE));
            t0.iter()
                .zip(&t1)
                .filter(|(a, b)| {
                    let (was, now) = (&before[**a as usize].0, &after[**b as usize].0);
                    was != changed && now != changed && was != now
                })
                .count()
        };
        let eight = named(&[1; 8]);
        let mut seven = eight.clone();
        let gone = seven.remove(3).0;
        assert!((moved(&eight, &seven, &gone) as f64) < 65537.0 * 0.01);
        let mut nine = eight.clone();
        nine.push(("10.0.0.99:8080".into(), 1));
        assert!((moved(&eight, &nine, "10.0.0.99:8080") as f64) < 65537.0 * 0.01);
        assert_eq!(table(&eight, DEFAULT_SIZE), table(&eight, DEFAULT_SIZE), "the same backends give the same table");
    }

    #[test]
    fn the_same_names_give_the_same_table_in_any_instance() {
        let a = table(&named(&[3, 1, 2]), 251);
        let b = table(&named(&[3, 1, 2]), 251);
        assert_eq!(a, b);
        assert!(a.iter().all(|s| *s < 3));
    }

    #[test]
    fn primes() {
        assert!(is_prime(65537) && is_prime(251) && is_prime(2) && is_prime(1_000_003));
        assert!(!is_prime(65536) && !is_prime(1) && !is_prime(0) && !is_prime(1_000_001));
    }
}
