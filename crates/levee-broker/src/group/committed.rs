//! The logged snapshot of a group's committed offsets: one record per commit batch, holding
//! every partition's offset (`u32` count, then one `u64` per partition, little-endian); only
//! the newest record matters. The layout is in docs/FORMAT.md.

/// A snapshot record of `committed` (one offset per partition).
pub fn encode_committed(committed: &[u64]) -> Vec<u8> {
    let mut record = Vec::with_capacity(4 + committed.len() * 8);
    // A topic has at most PARTITIONS_MAX partitions: the count fits.
    let count = u32::try_from(committed.len()).unwrap_or(0);
    record.extend_from_slice(&count.to_le_bytes());
    for offset in committed {
        record.extend_from_slice(&offset.to_le_bytes());
    }
    record
}

/// The offsets of a snapshot record (a short or torn record yields the whole offsets it holds).
pub fn decode_committed(record: &[u8]) -> Vec<u64> {
    record
        .get(4..)
        .unwrap_or_default()
        .chunks_exact(8)
        .map(|bytes| {
            let mut offset = [0; 8];
            offset.copy_from_slice(bytes);
            u64::from_le_bytes(offset)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_offsets_then_they_round_trip_in_the_documented_layout() {
        let record = encode_committed(&[1, 2, 3]);
        assert_eq!(&record[..4], &3_u32.to_le_bytes());
        assert_eq!(record.len(), 4 + 3 * 8);
        assert_eq!(decode_committed(&record), vec![1, 2, 3]);
        assert_eq!(decode_committed(&record[..10]), Vec::<u64>::new());
        assert_eq!(decode_committed(b""), Vec::<u64>::new());
    }
}
