//! When a consumer fails a message: a group's [`RetryPolicy`] (a schedule of delays and a most
//! number of attempts), the decision it makes for each failure ([`RetryPolicy::after_failure`]:
//! retry after a delay, or dead-letter), and the [`RetryRecord`] a retried or dead message
//! travels in: its original partition, offset and payload, how many attempts failed, and the
//! history of their errors. The layout of the record is in docs/FORMAT.md.

use serde::{Deserialize, Serialize};

/// Longest delay a retry step, a handler's retry or a delayed publish may ask for: 7 days.
pub const DELAY_MS_MAX: u64 = 7 * 24 * 3_600_000;
/// Most steps of a retry schedule.
pub const SCHEDULE_STEPS_MAX: usize = 32;
/// Most attempts a policy may allow.
pub const ATTEMPTS_MAX: u32 = 100;
/// Most failures a record's history keeps (the oldest go first).
pub const HISTORY_MAX: usize = 16;
/// Most bytes of one failure's error text (longer ones are cut at a character boundary).
pub const ERROR_BYTES_MAX: usize = 512;

/// The retry policy of a group when none was set: 1 s, 10 s, 1 min, 10 min, then the dead
/// letters after the fifth failed attempt.
pub const DEFAULT_DELAYS_MS: [u64; 4] = [1_000, 10_000, 60_000, 600_000];
/// See [`DEFAULT_DELAYS_MS`].
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// A group's retry policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// The delay before the second attempt, the third, ...; the last step repeats.
    pub delays_ms: Vec<u64>,
    /// Deliveries a message gets, the first included; after the last one fails it is
    /// dead-lettered.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            delays_ms: DEFAULT_DELAYS_MS.to_vec(),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }
}

/// Why a retry policy, or a handler's delay, was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RetryError {
    /// A schedule without steps, or with too many.
    #[error(
        "a retry schedule has 1 to {SCHEDULE_STEPS_MAX} steps (delays in ms, e.g. 1000,10000,\
         60000), got {steps}"
    )]
    Steps {
        /// Steps given.
        steps: usize,
    },
    /// A delay of 0 or beyond [`DELAY_MS_MAX`].
    #[error("delay {delay_ms} ms is out of range: a delay is 1 ms to {DELAY_MS_MAX} ms (7 days)")]
    Delay {
        /// The delay given.
        delay_ms: u64,
    },
    /// Attempts out of range.
    #[error("max_attempts must be 1 to {ATTEMPTS_MAX}, got {max_attempts}")]
    Attempts {
        /// The count given.
        max_attempts: u32,
    },
}

/// Checks one delay: 1 ms to [`DELAY_MS_MAX`].
pub fn check_delay(delay_ms: u64) -> Result<(), RetryError> {
    if delay_ms == 0 || delay_ms > DELAY_MS_MAX {
        return Err(RetryError::Delay { delay_ms });
    }
    Ok(())
}

/// What becomes of a failed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Deliver it to the group again after this many milliseconds.
    Retry {
        /// The delay.
        delay_ms: u64,
    },
    /// Move it to the group's dead letters.
    Dead,
}

impl RetryPolicy {
    /// Checks the policy's bounds.
    pub fn check(&self) -> Result<(), RetryError> {
        if self.delays_ms.is_empty() || self.delays_ms.len() > SCHEDULE_STEPS_MAX {
            return Err(RetryError::Steps {
                steps: self.delays_ms.len(),
            });
        }
        for &delay_ms in &self.delays_ms {
            check_delay(delay_ms)?;
        }
        if !(1..=ATTEMPTS_MAX).contains(&self.max_attempts) {
            return Err(RetryError::Attempts {
                max_attempts: self.max_attempts,
            });
        }
        Ok(())
    }

    /// What becomes of a message whose `failed`-th attempt just failed (1 for its first
    /// delivery): dead when `rejected` or when it has had `max_attempts`, else a retry after
    /// `delay_ms` (the handler's) or the schedule's step for that attempt.
    pub fn after_failure(&self, failed: u32, rejected: bool, delay_ms: Option<u64>) -> Next {
        if rejected || failed >= self.max_attempts {
            return Next::Dead;
        }
        let step = (failed.max(1) - 1) as usize;
        let scheduled = self
            .delays_ms
            .get(step)
            .or(self.delays_ms.last())
            .copied()
            .unwrap_or(DEFAULT_DELAYS_MS[0]);
        Next::Retry {
            delay_ms: delay_ms.unwrap_or(scheduled),
        }
    }
}

/// One failed attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// When it failed, ms since the Unix epoch (the server's clock).
    pub at_ms: u64,
    /// The handler's error, at most [`ERROR_BYTES_MAX`] bytes.
    pub error: String,
}

/// A message on its way through retries or in the dead letters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryRecord {
    /// Its original partition.
    pub partition: u32,
    /// Its original offset in that partition.
    pub offset: u64,
    /// Attempts that failed so far.
    pub attempts: u32,
    /// When it is due again (a retry), or when it was dead-lettered; ms since the Unix epoch.
    pub due_ms: u64,
    /// The newest [`HISTORY_MAX`] failures, oldest first.
    pub history: Vec<Failure>,
    /// The message.
    pub payload: Vec<u8>,
}

/// Version byte of [`RetryRecord`]'s layout.
const RECORD_VERSION: u8 = 1;

/// `text` cut to at most `max` bytes at a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Reads little-endian integers off the front of a slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, count: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(count)?;
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|bytes| bytes[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2)?.try_into().ok().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
}

impl RetryRecord {
    /// A message's first failure-free record: taken from `partition` at `offset`.
    pub fn first(partition: u32, offset: u64, payload: Vec<u8>) -> Self {
        Self {
            partition,
            offset,
            attempts: 0,
            due_ms: 0,
            history: Vec::new(),
            payload,
        }
    }

    /// Counts one more failed attempt at `now_ms` with `error` (cut to [`ERROR_BYTES_MAX`];
    /// the history keeps the newest [`HISTORY_MAX`]).
    pub fn fail(&mut self, now_ms: u64, error: &str) {
        self.attempts = self.attempts.saturating_add(1);
        if self.history.len() == HISTORY_MAX {
            self.history.remove(0);
        }
        self.history.push(Failure {
            at_ms: now_ms,
            error: truncate(error, ERROR_BYTES_MAX).to_owned(),
        });
    }

    /// The newest failure's error (empty before any).
    pub fn last_error(&self) -> &str {
        self.history.last().map_or("", |failure| &failure.error)
    }

    /// The record's bytes: version, partition, offset, attempts, due time, history count,
    /// each failure (time, error length, error), then the payload.
    pub fn encode(&self) -> Vec<u8> {
        let history_bytes: usize = self.history.iter().map(|f| 10 + f.error.len()).sum();
        let mut out = Vec::with_capacity(27 + history_bytes + self.payload.len());
        out.push(RECORD_VERSION);
        out.extend_from_slice(&self.partition.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.attempts.to_le_bytes());
        out.extend_from_slice(&self.due_ms.to_le_bytes());
        let count = self.history.len().min(HISTORY_MAX);
        // At most HISTORY_MAX failures of at most ERROR_BYTES_MAX bytes: both fit.
        out.extend_from_slice(&u16::try_from(count).unwrap_or(0).to_le_bytes());
        for failure in self.history.iter().take(HISTORY_MAX) {
            let error = truncate(&failure.error, ERROR_BYTES_MAX);
            out.extend_from_slice(&failure.at_ms.to_le_bytes());
            out.extend_from_slice(&u16::try_from(error.len()).unwrap_or(0).to_le_bytes());
            out.extend_from_slice(error.as_bytes());
        }
        out.extend_from_slice(&self.payload);
        out
    }

    /// A record from its bytes; `None` if they are not one (another version, torn).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut reader = Reader(bytes);
        if reader.u8()? != RECORD_VERSION {
            return None;
        }
        let partition = reader.u32()?;
        let offset = reader.u64()?;
        let attempts = reader.u32()?;
        let due_ms = reader.u64()?;
        let count = usize::from(reader.u16()?);
        if count > HISTORY_MAX {
            return None;
        }
        let mut history = Vec::with_capacity(count);
        for _ in 0..count {
            let at_ms = reader.u64()?;
            let length = usize::from(reader.u16()?);
            let error = std::str::from_utf8(reader.take(length)?).ok()?.to_owned();
            history.push(Failure { at_ms, error });
        }
        Some(Self {
            partition,
            offset,
            attempts,
            due_ms,
            history,
            payload: reader.0.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn given_the_default_schedule_then_each_failure_waits_its_step_and_the_fifth_is_dead() {
        let policy = RetryPolicy::default();
        policy.check().unwrap();
        let delays: Vec<Next> = (1..=5)
            .map(|failed| policy.after_failure(failed, false, None))
            .collect();
        assert_eq!(
            delays,
            [
                Next::Retry { delay_ms: 1_000 },
                Next::Retry { delay_ms: 10_000 },
                Next::Retry { delay_ms: 60_000 },
                Next::Retry { delay_ms: 600_000 },
                Next::Dead,
            ]
        );
        assert_eq!(policy.after_failure(1, true, None), Next::Dead, "rejected");
        assert_eq!(
            policy.after_failure(2, false, Some(5)),
            Next::Retry { delay_ms: 5 },
            "the handler's delay wins"
        );
        let long = RetryPolicy {
            delays_ms: vec![7],
            max_attempts: 10,
        };
        assert_eq!(
            long.after_failure(8, false, None),
            Next::Retry { delay_ms: 7 },
            "the last step repeats"
        );
    }

    #[test]
    fn given_bad_policies_then_each_is_refused_naming_its_bound() {
        let policy = |delays_ms: Vec<u64>, max_attempts| RetryPolicy {
            delays_ms,
            max_attempts,
        };
        assert_eq!(
            policy(vec![], 3).check(),
            Err(RetryError::Steps { steps: 0 })
        );
        assert_eq!(
            policy(vec![0], 3).check(),
            Err(RetryError::Delay { delay_ms: 0 })
        );
        let absurd = policy(vec![DELAY_MS_MAX + 1], 3).check().unwrap_err();
        assert!(absurd.to_string().contains("7 days"), "{absurd}");
        assert_eq!(
            policy(vec![1], 0).check(),
            Err(RetryError::Attempts { max_attempts: 0 })
        );
        assert!(policy(vec![1; SCHEDULE_STEPS_MAX + 1], 3).check().is_err());
    }

    #[test]
    fn given_many_failures_then_the_history_keeps_the_newest_and_errors_are_cut() {
        let mut record = RetryRecord::first(3, 9, b"pay".to_vec());
        for at in 0..20 {
            record.fail(at, &format!("error {at}"));
        }
        record.fail(99, &"é".repeat(ERROR_BYTES_MAX));
        assert_eq!(record.attempts, 21);
        assert_eq!(record.history.len(), HISTORY_MAX);
        assert_eq!(record.history[0].error, "error 5");
        assert!(record.last_error().len() <= ERROR_BYTES_MAX);
        assert_eq!(RetryRecord::decode(&record.encode()), Some(record));
        assert_eq!(RetryRecord::decode(b""), None);
        assert_eq!(RetryRecord::decode(&[2, 0, 0]), None, "another version");
    }

    proptest! {
        #[test]
        fn records_round_trip_and_torn_ones_never_panic(
            partition in any::<u32>(),
            offset in any::<u64>(),
            errors in proptest::collection::vec(".{0,40}", 0..20),
            payload in proptest::collection::vec(any::<u8>(), 0..100),
            cut in 0_usize..400,
        ) {
            let mut record = RetryRecord::first(partition, offset, payload);
            for (at, error) in (0_u64..).zip(&errors) {
                record.fail(at, error);
            }
            record.due_ms = 77;
            let bytes = record.encode();
            prop_assert_eq!(RetryRecord::decode(&bytes), Some(record));
            let _ = RetryRecord::decode(&bytes[..cut.min(bytes.len())]);
        }
    }
}
