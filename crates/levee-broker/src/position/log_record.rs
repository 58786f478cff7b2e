//! The position log's record: a version byte ([`LOG_RECORD_VERSION`]), the delete epoch of
//! its entries (u64 little-endian), then entries, each the queue name's length (one byte;
//! names are 1 to 255 bytes), the name, and the next offset to deliver (u64 little-endian).
//! Version 1 records (before delete epochs: no epoch, every entry in epoch 0) are still read.
//! The layout is in docs/FORMAT.md.

use crate::names::QUEUE_NAME_BYTES_MAX;

use super::Position;

/// The version byte every log record starts with.
pub const LOG_RECORD_VERSION: u8 = 2;
/// Bytes before a log record's first entry: the version and the delete epoch.
pub const LOG_RECORD_HEADER_BYTES: usize = 9;
/// Bytes of the largest entry: the longest queue name, its length and the offset.
pub const LOG_ENTRY_BYTES_MAX: usize = 1 + QUEUE_NAME_BYTES_MAX + 8;
const _: () = assert!(
    QUEUE_NAME_BYTES_MAX <= u8::MAX as usize,
    "a queue name's length fits the entry's length byte"
);

/// Why a log record cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LogRecordError {
    /// A record of no bytes.
    #[error("an empty record")]
    Empty,
    /// A version 2 record too short to hold its epoch.
    #[error("a record shorter than its epoch")]
    NoEpoch,
    /// A version this code does not read (a newer version wrote it, or it is damaged).
    #[error("record version {version}, this server reads 1 and {LOG_RECORD_VERSION}")]
    Version {
        /// The version byte found.
        version: u8,
    },
    /// An entry cut short or with an empty name.
    #[error("an entry of {name_bytes} name bytes runs past the record's end")]
    Truncated {
        /// The name length the entry gave.
        name_bytes: usize,
    },
}

/// Encodes `entries` (queue, next offset) in `epoch` as log records of at most
/// `record_bytes_max` bytes (at least one entry each). Queue names longer than a length byte
/// holds are skipped (names are checked to be 1 to 255 bytes where they enter).
pub fn encode_log_records<'a>(
    entries: impl Iterator<Item = (&'a [u8], u64)>,
    epoch: u64,
    record_bytes_max: usize,
) -> Vec<Vec<u8>> {
    let header = |epoch: u64| {
        let mut record = Vec::with_capacity(LOG_RECORD_HEADER_BYTES);
        record.push(LOG_RECORD_VERSION);
        record.extend_from_slice(&epoch.to_le_bytes());
        record
    };
    let mut records = Vec::new();
    let mut record = header(epoch);
    for (queue, next) in entries {
        let Ok(length) = u8::try_from(queue.len()) else {
            continue;
        };
        if record.len() > LOG_RECORD_HEADER_BYTES
            && record.len() + 1 + queue.len() + 8 > record_bytes_max
        {
            records.push(std::mem::replace(&mut record, header(epoch)));
        }
        record.push(length);
        record.extend_from_slice(queue);
        record.extend_from_slice(&next.to_le_bytes());
    }
    if record.len() > LOG_RECORD_HEADER_BYTES {
        records.push(record);
    }
    records
}

/// Encodes `entries` (queue, position) as log records: one run of records per run of entries
/// of one epoch, in the order given.
pub fn encode_stamped_records<'a>(
    entries: impl Iterator<Item = (&'a [u8], Position)>,
    record_bytes_max: usize,
) -> Vec<Vec<u8>> {
    let entries: Vec<(&[u8], Position)> = entries.collect();
    entries
        .chunk_by(|(_, one), (_, other)| one.epoch == other.epoch)
        .flat_map(|run| {
            encode_log_records(
                run.iter().map(|(queue, position)| (*queue, position.next)),
                run[0].1.epoch,
                record_bytes_max,
            )
        })
        .collect()
}

/// Reads a log record, handing each entry to `each`; returns how many it held.
pub(super) fn decode(
    record: &[u8],
    mut each: impl FnMut(&[u8], Position),
) -> Result<u64, LogRecordError> {
    let (epoch, mut rest) = match record.split_first() {
        None => return Err(LogRecordError::Empty),
        Some((&1, rest)) => (0, rest),
        Some((&LOG_RECORD_VERSION, rest)) => match rest.split_first_chunk::<8>() {
            Some((epoch, rest)) => (u64::from_le_bytes(*epoch), rest),
            None => return Err(LogRecordError::NoEpoch),
        },
        Some((&version, _)) => return Err(LogRecordError::Version { version }),
    };
    let mut entries = 0;
    while let Some((&length, after)) = rest.split_first() {
        entries += 1;
        let name_bytes = usize::from(length);
        if name_bytes == 0 || after.len() < name_bytes + 8 {
            return Err(LogRecordError::Truncated { name_bytes });
        }
        let (queue, after) = after.split_at(name_bytes);
        let Some((next, after)) = after.split_first_chunk::<8>() else {
            return Err(LogRecordError::Truncated { name_bytes });
        };
        each(
            queue,
            Position {
                epoch,
                next: u64::from_le_bytes(*next),
            },
        );
        rest = after;
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::super::PositionBook;
    use super::*;

    /// The largest record size the server uses.
    const RECORD_BYTES_MAX: usize = 64 << 10;

    #[test]
    fn given_entries_then_records_split_and_apply_as_the_largest_position() {
        let entries: Vec<(Vec<u8>, u64)> = (0..1_000_u64)
            .map(|index| {
                let mut name = vec![b'q'; QUEUE_NAME_BYTES_MAX];
                name[..8].copy_from_slice(&index.to_le_bytes());
                (name, index)
            })
            .collect();
        let records = encode_log_records(
            entries.iter().map(|(name, next)| (&name[..], *next)),
            0,
            RECORD_BYTES_MAX,
        );
        assert!(records.len() > 1, "264 KB of entries span several records");
        assert!(
            records
                .iter()
                .all(|record| record.len() <= RECORD_BYTES_MAX)
        );
        let mut book = PositionBook::default();
        for record in &records {
            book.apply_record(record).unwrap();
        }
        assert_eq!(book.len(), 1_000);
        // An older position read later changes nothing; a newer one wins.
        let one = |next| encode_log_records([(&entries[5].0[..], next)].into_iter(), 0, 1 << 10);
        book.apply_record(&one(1)[0]).unwrap();
        assert_eq!(
            book.get(&entries[5].0),
            Some(Position { epoch: 0, next: 5 })
        );
        book.apply_record(&one(9)[0]).unwrap();
        assert_eq!(
            book.get(&entries[5].0),
            Some(Position { epoch: 0, next: 9 })
        );

        let cut = &records[0][..records[0].len() - 3];
        assert!(matches!(
            book.apply_record(cut),
            Err(LogRecordError::Truncated { .. })
        ));
        let mut other_version = records[0].clone();
        other_version[0] = 7;
        assert_eq!(
            book.apply_record(&other_version).unwrap_err().to_string(),
            "record version 7, this server reads 1 and 2"
        );
        assert_eq!(book.apply_record(&[2, 0]), Err(LogRecordError::NoEpoch));
        assert_eq!(book.apply_record(&[]), Err(LogRecordError::Empty));
    }

    #[test]
    fn given_a_version_1_record_then_its_entries_are_in_epoch_0() {
        let mut version_1 = vec![1_u8, 1, b'q'];
        version_1.extend_from_slice(&900_u64.to_le_bytes());
        let mut book = PositionBook::default();
        assert_eq!(book.apply_record(&version_1), Ok(1));
        assert_eq!(
            book.get(b"q"),
            Some(Position {
                epoch: 0,
                next: 900
            })
        );
    }
}
