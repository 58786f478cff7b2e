//! The single-queue position record: what a `Subscribe` stream's ack writes to the consumer's
//! position queue for that queue. The next offset to deliver (u64 little-endian), then the
//! queue's name, so that two queues whose names hash alike are told apart. The layout is in
//! docs/FORMAT.md.

/// A position record names another queue than the one looked up: the position queue's hash
/// of the name collided.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the position record does not match this queue")]
pub struct PositionMismatch;

/// The record of `queue`'s next offset `next`.
pub fn encode_queue_position(next: u64, queue: &[u8]) -> Vec<u8> {
    let mut record = next.to_le_bytes().to_vec();
    record.extend_from_slice(queue);
    record
}

/// The next offset a record gives `queue`.
pub fn decode_queue_position(record: &[u8], queue: &[u8]) -> Result<u64, PositionMismatch> {
    match record.split_first_chunk::<8>() {
        Some((next, stored_queue)) if stored_queue == queue => Ok(u64::from_le_bytes(*next)),
        _ => Err(PositionMismatch),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_record_then_only_its_own_queue_reads_it() {
        let record = encode_queue_position(7, b"orders");
        assert_eq!(&record[..8], &7_u64.to_le_bytes());
        assert_eq!(decode_queue_position(&record, b"orders"), Ok(7));
        assert_eq!(
            decode_queue_position(&record, b"other"),
            Err(PositionMismatch)
        );
        assert_eq!(decode_queue_position(b"short", b""), Err(PositionMismatch));
    }
}
