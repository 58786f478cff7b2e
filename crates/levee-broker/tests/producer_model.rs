//! Property test of idempotent producers against a simple model: a producer sends new
//! batches, resends earlier ones and sends batches that skip ahead, on two queues, with other
//! writers' messages in between. The model keeps every batch ever stored with its offsets.
//!
//! Invariants: a new batch is judged new and stored once; a resend of one of the queue's last
//! `RUNS_KEPT` batches (or of a part of one) gets its original offsets and is never stored
//! again; an older resend is refused as too old; a batch that skips ahead is refused as a gap.

use levee_broker::producer::{ProducerRuns, RUNS_KEPT, Run, SequenceError, Verdict};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Step {
    /// New messages on queue `queue`, after `others` messages of other writers.
    Send {
        queue: usize,
        count: u64,
        others: u64,
    },
    /// A resend of the `back`-th latest batch on `queue` (a part of it when `part`).
    Resend {
        queue: usize,
        back: usize,
        part: bool,
    },
    /// A batch that starts `skip` past the next sequence.
    Skip { queue: usize, skip: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0_usize..2, 1_u64..5, 0_u64..3)
            .prop_map(|(queue, count, others)| Step::Send { queue, count, others }),
        2 => (0_usize..2, 0_usize..12, any::<bool>())
            .prop_map(|(queue, back, part)| Step::Resend { queue, back, part }),
        1 => (0_usize..2, 1_u64..4).prop_map(|(queue, skip)| Step::Skip { queue, skip }),
    ]
}

/// One stored batch: first sequence, count, first offset.
#[derive(Debug, Clone, Copy)]
struct Batch {
    first_sequence: u64,
    count: u64,
    first_offset: u64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn given_any_sends_and_resends_then_nothing_is_stored_twice(
        steps in proptest::collection::vec(step(), 1..80),
    ) {
        let queues: [&[u8]; 2] = [b"orders", b"invoices"];
        let mut runs = ProducerRuns::default();
        let mut stored: [Vec<Batch>; 2] = [Vec::new(), Vec::new()];
        let mut ends = [0_u64; 2];
        for step in steps {
            match step {
                Step::Send { queue, count, others } => {
                    let next = stored[queue].last().map_or(0, |batch| batch.first_sequence + batch.count);
                    let verdict = runs.judge(queues[queue], next, next + count - 1);
                    prop_assert_eq!(verdict, Ok(Verdict::New));
                    ends[queue] += others;
                    let batch = Batch { first_sequence: next, count, first_offset: ends[queue] };
                    ends[queue] += count;
                    runs.record(queues[queue], Run {
                        first_sequence: batch.first_sequence,
                        count,
                        first_offset: batch.first_offset,
                        ticket: None,
                    });
                    stored[queue].push(batch);
                }
                Step::Resend { queue, back, part } => {
                    let Some(&batch) = stored[queue].iter().rev().nth(back) else { continue };
                    let skip = u64::from(part && batch.count > 1);
                    let first = batch.first_sequence + skip;
                    let last = batch.first_sequence + batch.count - 1;
                    let verdict = runs.judge(queues[queue], first, last);
                    if back < RUNS_KEPT {
                        prop_assert_eq!(verdict, Ok(Verdict::Resend {
                            first_offset: batch.first_offset + skip,
                            ticket: None,
                        }));
                    } else {
                        prop_assert!(
                            matches!(verdict, Err(SequenceError::TooOld { .. })),
                            "{verdict:?}"
                        );
                    }
                }
                Step::Skip { queue, skip } => {
                    let next = stored[queue].last().map_or(0, |batch| batch.first_sequence + batch.count);
                    let verdict = runs.judge(queues[queue], next + skip, next + skip);
                    prop_assert!(
                        matches!(
                            verdict,
                            Err(SequenceError::Gap { .. } | SequenceError::FirstGap { .. })
                        ),
                        "{verdict:?}"
                    );
                }
            }
        }
    }
}
