//! Idempotent producers: what the broker remembers of a producer's recent appends so that a
//! resent one is answered with its original offsets and stores nothing twice. It owns
//!
//! - [`ProducerRuns`]: per queue, the last [`RUNS_KEPT`] runs a producer stored (a run is one
//!   request's consecutive messages for one queue: first sequence, count, first offset; a
//!   queue's messages of one request get consecutive offsets), and the judgement of a new
//!   request's run against them ([`Verdict`]): new, a resend, or refused ([`SequenceError`]:
//!   a gap, a mix of stored and new sequences, too old);
//! - [`request_runs`]: a request's messages grouped into one run per queue;
//! - the record a producer's stored runs are logged as ([`encode_runs`],
//!   [`ProducerRuns::load_record`]); the layout is in docs/FORMAT.md.
//!
//! Bounds: [`QUEUES_PER_PRODUCER_MAX`] queues per producer (the oldest is forgotten first; a
//! forgotten queue accepts its next sequence as new) and [`PRODUCERS_MAX`] producers, which the
//! runtime's table of producers enforces.

use std::collections::{HashMap, VecDeque};

use levee_store::CommitTicket;

/// Producers remembered at once (the least recently used is forgotten first).
pub const PRODUCERS_MAX: usize = 10_000;
/// Queues remembered per producer.
pub const QUEUES_PER_PRODUCER_MAX: usize = 100_000;
/// Runs remembered per (producer, queue): a resend of one of the last this-many requests that
/// touched the queue gets its original offsets.
pub const RUNS_KEPT: usize = 8;
/// Bytes of a logged run after its queue name: first sequence, count, first offset.
const RUN_FIXED_BYTES: usize = 24;

/// One request's consecutive messages for one queue, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// The producer's sequence of its first message.
    pub first_sequence: u64,
    /// How many messages (at least one).
    pub count: u64,
    /// The offset its first message was stored at.
    pub first_offset: u64,
    /// What makes the run durable, while this process knows it (`None` once loaded back).
    pub ticket: Option<CommitTicket>,
}

impl Run {
    /// The sequence of its last message (runs are checked on the way in to end by
    /// `u64::MAX`; a run of no messages ends where it starts).
    pub fn last_sequence(&self) -> u64 {
        self.first_sequence
            .saturating_add(self.count.saturating_sub(1))
    }
}

/// What a request's run for one queue is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// New messages: store them.
    New,
    /// Every sequence was stored already: answer with the original offsets.
    Resend {
        /// The offset of the request's first message.
        first_offset: u64,
        /// What made the original durable, if this process stored it.
        ticket: Option<CommitTicket>,
    },
}

/// Why a request's sequences were refused; nothing of the request is stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SequenceError {
    /// A first run on a queue that does not start at 0.
    #[error(
        "queue '{queue}': sequence {first} skips ahead; this producer's first sequence on the \
         queue is 0. Resend the missing messages first"
    )]
    FirstGap {
        /// The queue, as text.
        queue: String,
        /// The request's first sequence.
        first: u64,
    },
    /// A run that starts past the next expected sequence.
    #[error(
        "queue '{queue}': sequence {first} skips ahead; the next expected is {expected}. Resend \
         the missing messages first"
    )]
    Gap {
        /// The queue, as text.
        queue: String,
        /// The request's first sequence.
        first: u64,
        /// The next sequence the queue expects.
        expected: u64,
    },
    /// A run holding both stored and new sequences.
    #[error(
        "queue '{queue}': sequences {first}..={last} mix stored ones (up to {stored_up_to}) \
         with new ones; resend batches exactly as first sent"
    )]
    Mixed {
        /// The queue, as text.
        queue: String,
        /// The request's first sequence.
        first: u64,
        /// The request's last sequence.
        last: u64,
        /// The last stored sequence.
        stored_up_to: u64,
    },
    /// A resend older than every remembered run.
    #[error(
        "queue '{queue}': sequences {first}..={last} were stored earlier than the last \
         {RUNS_KEPT} requests the server remembers; they were not stored again"
    )]
    TooOld {
        /// The queue, as text.
        queue: String,
        /// The request's first sequence.
        first: u64,
        /// The request's last sequence.
        last: u64,
    },
    /// A request whose sequences for one queue are not consecutive.
    #[error(
        "queue '{queue}': sequences within one request must be consecutive, got {sequence} \
         after {previous}"
    )]
    NotConsecutive {
        /// The queue, as text.
        queue: String,
        /// The sequence out of order.
        sequence: u64,
        /// The one before it.
        previous: u64,
    },
}

/// A queue name for a message.
fn text(queue: &[u8]) -> String {
    String::from_utf8_lossy(queue).into_owned()
}

/// A request's messages for one queue: their indexes in the request, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRun<'a> {
    /// The queue.
    pub queue: &'a [u8],
    /// The indexes of its messages in the request.
    pub indexes: Vec<usize>,
    /// The first message's sequence.
    pub first: u64,
    /// The last message's sequence.
    pub last: u64,
}

/// Groups a request's messages (queue, sequence), in order, into one run per queue, in the
/// order queues first appear. Each queue's sequences must be consecutive.
pub fn request_runs<'a>(
    messages: impl Iterator<Item = (&'a [u8], u64)>,
) -> Result<Vec<RequestRun<'a>>, SequenceError> {
    let mut runs: Vec<RequestRun<'a>> = Vec::new();
    let mut slots: HashMap<&[u8], usize> = HashMap::new();
    for (index, (queue, sequence)) in messages.enumerate() {
        let slot = *slots.entry(queue).or_insert_with(|| {
            runs.push(RequestRun {
                queue,
                indexes: Vec::new(),
                first: sequence,
                last: sequence,
            });
            runs.len() - 1
        });
        let run = &mut runs[slot];
        if !run.indexes.is_empty() {
            if run.last.checked_add(1) != Some(sequence) {
                return Err(SequenceError::NotConsecutive {
                    queue: text(queue),
                    sequence,
                    previous: run.last,
                });
            }
            run.last = sequence;
        }
        run.indexes.push(index);
    }
    Ok(runs)
}

/// One producer's remembered runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerRuns {
    queues: HashMap<Vec<u8>, VecDeque<Run>>,
    /// Order in which queues were first seen, for forgetting the oldest.
    queue_order: VecDeque<Vec<u8>>,
    /// Whether every queue this producer ever stored to is remembered (nothing forgotten or
    /// trimmed away). Then a queue not remembered is new to the producer, and its first
    /// sequence must be 0: a higher one means an earlier batch has not arrived yet.
    complete: bool,
}

impl Default for ProducerRuns {
    fn default() -> Self {
        Self {
            queues: HashMap::new(),
            queue_order: VecDeque::new(),
            complete: true,
        }
    }
}

impl ProducerRuns {
    /// Remembers a stored run of `queue`, forgetting the queue's oldest run past
    /// [`RUNS_KEPT`] and the producer's oldest queue past [`QUEUES_PER_PRODUCER_MAX`].
    pub fn record(&mut self, queue: &[u8], run: Run) {
        if !self.queues.contains_key(queue) {
            if self.queues.len() >= QUEUES_PER_PRODUCER_MAX
                && let Some(oldest) = self.queue_order.pop_front()
            {
                self.queues.remove(&oldest);
                self.complete = false;
            }
            self.queue_order.push_back(queue.to_vec());
        }
        let runs = self.queues.entry(queue.to_vec()).or_default();
        if runs.len() >= RUNS_KEPT {
            runs.pop_front();
        }
        runs.push_back(run);
    }

    /// Judges a request's run `first..=last` of `queue` against the remembered runs.
    pub fn judge(&self, queue: &[u8], first: u64, last: u64) -> Result<Verdict, SequenceError> {
        let runs = self.queues.get(queue);
        let Some(last_run) = runs.and_then(VecDeque::back) else {
            if self.complete && first != 0 {
                return Err(SequenceError::FirstGap {
                    queue: text(queue),
                    first,
                });
            }
            return Ok(Verdict::New);
        };
        // After a run ending at u64::MAX no sequence is new: every request is a resend.
        if let Some(expected) = last_run.last_sequence().checked_add(1) {
            if first == expected {
                return Ok(Verdict::New);
            }
            if first > expected {
                return Err(SequenceError::Gap {
                    queue: text(queue),
                    first,
                    expected,
                });
            }
            if last >= expected {
                return Err(SequenceError::Mixed {
                    queue: text(queue),
                    first,
                    last,
                    stored_up_to: expected - 1,
                });
            }
        }
        for run in runs.into_iter().flatten() {
            if run.first_sequence <= first && last <= run.last_sequence() {
                return Ok(Verdict::Resend {
                    first_offset: run.first_offset.saturating_add(first - run.first_sequence),
                    ticket: run.ticket,
                });
            }
        }
        Err(SequenceError::TooOld {
            queue: text(queue),
            first,
            last,
        })
    }

    /// Remembers the runs of one logged record (see [`encode_runs`]); a torn tail is left
    /// out.
    pub fn load_record(&mut self, mut record: &[u8]) {
        while let Some((&length, rest)) = record.split_first() {
            let length = usize::from(length);
            if rest.len() < length + RUN_FIXED_BYTES {
                return;
            }
            let (queue, rest) = rest.split_at(length);
            let number = |at: usize| {
                let mut bytes = [0; 8];
                bytes.copy_from_slice(&rest[at..at + 8]);
                u64::from_le_bytes(bytes)
            };
            let run = Run {
                first_sequence: number(0),
                count: number(8),
                first_offset: number(16),
                ticket: None,
            };
            // A damaged run (no messages, or sequences or offsets past u64::MAX) is left out.
            let fits = run.first_sequence.checked_add(run.count).is_some()
                && run.first_offset.checked_add(run.count).is_some();
            if run.count > 0 && fits {
                self.record(queue, run);
            }
            record = &rest[RUN_FIXED_BYTES..];
        }
    }
}

/// The record of stored runs: per queue, the name's length (u8), the name, first sequence,
/// count and first offset (u64 each), little-endian.
pub fn encode_runs(runs: &[(&[u8], Run)]) -> Vec<u8> {
    let mut record = Vec::new();
    for (queue, run) in runs {
        // Queue names are at most 255 bytes (the store's bound).
        record.push(u8::try_from(queue.len()).unwrap_or(u8::MAX));
        record.extend_from_slice(queue);
        record.extend_from_slice(&run.first_sequence.to_le_bytes());
        record.extend_from_slice(&run.count.to_le_bytes());
        record.extend_from_slice(&run.first_offset.to_le_bytes());
    }
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(first_sequence: u64, count: u64, first_offset: u64) -> Run {
        Run {
            first_sequence,
            count,
            first_offset,
            ticket: None,
        }
    }

    #[test]
    fn given_stored_runs_then_requests_are_judged_new_resent_or_refused() {
        let mut runs = ProducerRuns::default();
        assert!(matches!(
            runs.judge(b"q", 2, 3),
            Err(SequenceError::FirstGap { first: 2, .. })
        ));
        assert_eq!(runs.judge(b"q", 0, 1), Ok(Verdict::New));
        runs.record(b"q", run(0, 2, 10));
        assert_eq!(runs.judge(b"q", 2, 4), Ok(Verdict::New));
        assert_eq!(
            runs.judge(b"q", 1, 1),
            Ok(Verdict::Resend {
                first_offset: 11,
                ticket: None
            })
        );
        let gap = runs.judge(b"q", 3, 3).unwrap_err();
        assert!(gap.to_string().contains("next expected is 2"), "{gap}");
        assert!(matches!(
            runs.judge(b"q", 1, 2),
            Err(SequenceError::Mixed {
                stored_up_to: 1,
                ..
            })
        ));
        for sequence in 2..2 + RUNS_KEPT as u64 {
            runs.record(b"q", run(sequence, 1, 10 + sequence));
        }
        assert!(matches!(
            runs.judge(b"q", 0, 1),
            Err(SequenceError::TooOld { .. })
        ));
    }

    #[test]
    fn given_a_run_ending_at_the_last_sequence_then_its_resend_is_not_taken_as_new() {
        let mut runs = ProducerRuns::default();
        runs.record(b"q", run(u64::MAX - 1, 2, 40));
        assert_eq!(
            runs.judge(b"q", u64::MAX, u64::MAX),
            Ok(Verdict::Resend {
                first_offset: 41,
                ticket: None
            })
        );
    }

    #[test]
    fn given_a_request_then_runs_group_by_queue_and_must_be_consecutive() {
        let messages = [(&b"a"[..], 4), (b"b", 0), (b"a", 5), (b"b", 1)];
        let runs = request_runs(messages.into_iter()).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (runs[0].queue, runs[0].first, runs[0].last),
            (&b"a"[..], 4, 5)
        );
        assert_eq!(runs[0].indexes, [0, 2]);
        assert_eq!(runs[1].indexes, [1, 3]);
        let unordered = [(&b"a"[..], 5), (b"a", 4)];
        assert!(matches!(
            request_runs(unordered.into_iter()),
            Err(SequenceError::NotConsecutive {
                sequence: 4,
                previous: 5,
                ..
            })
        ));
    }

    #[test]
    fn given_logged_runs_then_loading_them_back_judges_alike_and_skips_a_torn_tail() {
        let record = encode_runs(&[(&b"a"[..], run(0, 2, 7)), (b"b", run(0, 3, 0))]);
        let mut loaded = ProducerRuns::default();
        loaded.load_record(&record[..record.len() - 1]);
        assert_eq!(
            loaded.judge(b"a", 0, 1),
            Ok(Verdict::Resend {
                first_offset: 7,
                ticket: None
            })
        );
        assert!(
            matches!(
                loaded.judge(b"b", 1, 1),
                Err(SequenceError::FirstGap { .. })
            ),
            "the torn run of b is left out"
        );
        loaded.load_record(&record);
        assert_eq!(loaded.judge(b"b", 3, 3), Ok(Verdict::New));
    }
}
