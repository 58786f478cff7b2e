//! Store options: sync policy, segment and chunk sizes, the write-buffer budget and the largest
//! message. Every size has a named bound and is checked by [`StoreOptions::validate`].

use std::fmt;
use std::str::FromStr;

use crate::error::OptionsError;
use crate::format::RECORD_BODY_BYTES_MAX;

/// When an append's bytes are fsynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncPolicy {
    /// An append returns only after its bytes are fsynced; concurrent appends share one fsync
    /// (group commit).
    #[default]
    Always,
    /// An append returns once buffered; buffered data is written and fsynced within
    /// `interval_ms`.
    Interval {
        /// Longest time, in ms, between an append and the fsync that covers it.
        interval_ms: u64,
    },
}

impl fmt::Display for SyncPolicy {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncPolicy::Always => formatter.write_str("always"),
            SyncPolicy::Interval { interval_ms } => write!(formatter, "interval({interval_ms})"),
        }
    }
}

impl FromStr for SyncPolicy {
    type Err = OptionsError;

    /// Parses `always`, `interval` (100 ms) or `interval(N)` with N in ms.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "always" => Ok(SyncPolicy::Always),
            "interval" => Ok(SyncPolicy::Interval {
                interval_ms: SYNC_INTERVAL_MS_DEFAULT,
            }),
            _ => text
                .strip_prefix("interval(")
                .and_then(|rest| rest.strip_suffix(')'))
                .and_then(|number| number.parse().ok())
                .map(|interval_ms| SyncPolicy::Interval { interval_ms })
                .ok_or_else(|| OptionsError::SyncPolicy(text.to_string())),
        }
    }
}

/// Default interval of [`SyncPolicy::Interval`] when parsed from plain `interval`.
pub const SYNC_INTERVAL_MS_DEFAULT: u64 = 100;
/// Longest accepted sync interval (1 minute).
pub const SYNC_INTERVAL_MS_MAX: u64 = 60_000;
/// Largest accepted segment size; positions in a segment must fit in a u32.
pub const SEGMENT_BYTES_MAX_LIMIT: u64 = 1 << 31;
/// Largest accepted message size.
pub const MESSAGE_BYTES_MAX_LIMIT: usize = 64 << 20;

/// Options of [`crate::Store::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// When appends are fsynced.
    pub sync: SyncPolicy,
    /// A segment file is closed and a new one started when the next record would pass this
    /// size (a single record larger than it gets a segment of its own).
    pub segment_bytes_max: u64,
    /// A queue's buffered messages are sealed into a chunk record once they reach this many
    /// payload bytes; a chunk holds at most this many payload bytes unless a single message is
    /// larger.
    pub chunk_bytes: usize,
    /// Global bound on buffered message bytes and unwritten log records over all queues
    /// (default 320 MiB). Appends block while it is exceeded; past seven eighths a flush is
    /// asked for early, which writes the logs or seals the oldest eighth of the buffers. At
    /// a million queues it sets the chunk size, so the index per message: 320 MiB gives about
    /// seven messages of 58 bytes per chunk and 0.87 bytes of index per message.
    pub buffer_budget_bytes: usize,
    /// Largest message accepted, in bytes.
    pub message_bytes_max: usize,
    /// A commit round writes what it built so far (without an fsync) once its chunks pass
    /// this many bytes, and goes on in an empty buffer, so the round buffer stays this small
    /// even when a round seals a budget's worth of buffers.
    pub round_write_bytes: usize,
    /// Write the large runs of commit rounds with `O_DIRECT` (default true; used by
    /// [`crate::Store::open`], a storage given to `open_with_storage` decides for itself). The
    /// page cache then holds none of the data written: no page-cache page to fill per 4 KiB
    /// written (on a VM whose freed memory the host takes back, each such page is a host page
    /// fault) and no writeback at the fsync, but the first read of a sealed chunk comes from
    /// the disk. The unaligned ends of each write, and writes under 64 KiB, go through the page
    /// cache; a file system that refuses `O_DIRECT` gets every write through it.
    pub direct_writes: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            sync: SyncPolicy::Always,
            segment_bytes_max: 256 << 20,
            chunk_bytes: 4096,
            buffer_budget_bytes: 320 << 20,
            message_bytes_max: 1 << 20,
            round_write_bytes: 8 << 20,
            direct_writes: true,
        }
    }
}

impl StoreOptions {
    /// Checks every bound; returns the first one broken, with the value found.
    pub fn validate(&self) -> Result<(), OptionsError> {
        if !(4096..=SEGMENT_BYTES_MAX_LIMIT).contains(&self.segment_bytes_max) {
            return Err(OptionsError::SegmentBytes(self.segment_bytes_max));
        }
        if !(1..=RECORD_BODY_BYTES_MAX / 2).contains(&self.chunk_bytes) {
            return Err(OptionsError::ChunkBytes(self.chunk_bytes));
        }
        if !(1..=MESSAGE_BYTES_MAX_LIMIT).contains(&self.message_bytes_max) {
            return Err(OptionsError::MessageBytes(self.message_bytes_max));
        }
        if self.buffer_budget_bytes < self.chunk_bytes.max(self.message_bytes_max) {
            return Err(OptionsError::BufferBudget(self.buffer_budget_bytes));
        }
        if self.round_write_bytes == 0 {
            return Err(OptionsError::RoundWriteBytes);
        }
        if let SyncPolicy::Interval { interval_ms } = self.sync
            && !(1..=SYNC_INTERVAL_MS_MAX).contains(&interval_ms)
        {
            return Err(OptionsError::SyncInterval(interval_ms));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_policy_text_when_parsed_should_roundtrip_through_display() {
        for policy in [SyncPolicy::Always, SyncPolicy::Interval { interval_ms: 25 }] {
            assert_eq!(policy.to_string().parse::<SyncPolicy>().ok(), Some(policy));
        }
        assert!("sometimes".parse::<SyncPolicy>().is_err());
    }

    #[test]
    fn given_zero_chunk_when_validated_should_name_the_option() {
        let options = StoreOptions {
            chunk_bytes: 0,
            ..StoreOptions::default()
        };
        let error = options.validate().err().map(|error| error.to_string());
        assert!(error.is_some_and(|text| text.contains("chunk_bytes")));
    }
}
