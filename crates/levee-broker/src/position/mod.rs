//! Mailbox positions: where each consumer's delivery stands on each queue. It owns
//!
//! - [`Position`]: a queue's delivery position, the epoch of its acks then the next offset to
//!   deliver; positions compare in that order and only ever grow;
//! - [`PositionBook`]: every position one consumer's log holds, built by applying log
//!   records in any order, any number of times (the largest position wins);
//! - `log_record`: the position log's record layout (version, delete epoch, entries);
//! - `queue_record`: the single-queue position record (next offset, then the queue's name).
//!
//! Epochs: a queue delete writes a forget (next offset 0) in a fresh epoch, higher than any
//! before; an ack is written in its queue's epoch as the stream found it when it added the
//! queue, so the acks of one incarnation of a queue share an epoch and only grow, a forget
//! outranks every ack of the incarnations before it and is outranked by every ack after it,
//! whatever order the records are read in. Nothing here does I/O: the server decides where
//! the records live and when a log is compacted.

mod log_record;
mod queue_record;

use std::collections::HashMap;

pub use log_record::{
    LOG_ENTRY_BYTES_MAX, LOG_RECORD_HEADER_BYTES, LOG_RECORD_VERSION, LogRecordError,
    encode_log_records, encode_stamped_records,
};
pub use queue_record::{PositionMismatch, decode_queue_position, encode_queue_position};

/// A queue's delivery position: the epoch of its acks, then the next offset to deliver.
/// Positions compare in that order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Position {
    /// The epoch of the queue's acks.
    pub epoch: u64,
    /// The next offset to deliver.
    pub next: u64,
}

/// Every position one consumer's log holds, as far as it has been read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PositionBook {
    positions: HashMap<Box<[u8]>, Position>,
}

impl PositionBook {
    /// Applies one log record: each entry raises its queue's position to the entry's if that
    /// is larger. Returns how many entries it held, or why it cannot be read (nothing of a
    /// record past its damage is applied; entries before it are, which is safe: positions
    /// only grow).
    pub fn apply_record(&mut self, record: &[u8]) -> Result<u64, LogRecordError> {
        log_record::decode(record, |queue, position| {
            match self.positions.get_mut(queue) {
                Some(known) => *known = (*known).max(position),
                None => {
                    self.positions.insert(queue.into(), position);
                }
            }
        })
    }

    /// `queue`'s position, if the log holds one.
    pub fn get(&self, queue: &[u8]) -> Option<Position> {
        self.positions.get(queue).copied()
    }

    /// Keeps only the positions `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&[u8], Position) -> bool) {
        self.positions
            .retain(|queue, position| keep(queue, *position));
    }

    /// Every queue's position, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], Position)> {
        self.positions
            .iter()
            .map(|(queue, position)| (&queue[..], *position))
    }

    /// How many queues have a position.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no queue has one.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Every position as a snapshot's log records of at most `record_bytes_max` bytes: one
    /// run of records per epoch, epochs in order.
    pub fn snapshot_records(&self, record_bytes_max: usize) -> Vec<Vec<u8>> {
        let mut entries: Vec<(&[u8], Position)> = self
            .positions
            .iter()
            .map(|(queue, position)| (&queue[..], *position))
            .collect();
        entries.sort_unstable_by_key(|(_, position)| position.epoch);
        encode_stamped_records(entries.into_iter(), record_bytes_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_forget_and_older_entries_in_any_order_then_the_forget_wins_and_later_acks_win() {
        let stale = encode_log_records([(&b"q"[..], 500)].into_iter(), 3, 1 << 10);
        let forget = encode_log_records([(&b"q"[..], 0)].into_iter(), 4, 1 << 10);
        let later = encode_log_records([(&b"q"[..], 2)].into_iter(), 4, 1 << 10);
        let mut version_1 = vec![1_u8, 1, b'q'];
        version_1.extend_from_slice(&900_u64.to_le_bytes());
        let orders: [&[&Vec<u8>]; 3] = [
            &[&stale[0], &forget[0], &version_1],
            &[&forget[0], &version_1, &stale[0]],
            &[&version_1, &forget[0], &stale[0], &stale[0]],
        ];
        for order in orders {
            let mut book = PositionBook::default();
            for record in order {
                book.apply_record(record).unwrap();
            }
            assert_eq!(book.get(b"q"), Some(Position { epoch: 4, next: 0 }));
            book.apply_record(&later[0]).unwrap();
            assert_eq!(book.get(b"q"), Some(Position { epoch: 4, next: 2 }));
        }
    }

    #[test]
    fn given_a_book_then_its_snapshot_replays_into_an_equal_one() {
        let mut book = PositionBook::default();
        for (queue, epoch, next) in [(&b"a"[..], 2, 7), (b"b", 0, 3), (b"c", 2, 1)] {
            let records = encode_log_records([(queue, next)].into_iter(), epoch, 64);
            book.apply_record(&records[0]).unwrap();
        }
        let mut replayed = PositionBook::default();
        for record in book.snapshot_records(24) {
            assert!(record.len() <= 24 || record.len() == LOG_RECORD_HEADER_BYTES + 10);
            replayed.apply_record(&record).unwrap();
        }
        assert_eq!(replayed, book);
        book.retain(|queue, position| queue != b"a" && position.next > 1);
        assert_eq!(book.len(), 1);
        assert_eq!(book.get(b"b"), Some(Position { epoch: 0, next: 3 }));
    }
}
