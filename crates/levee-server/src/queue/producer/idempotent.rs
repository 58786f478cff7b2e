//! Idempotent producers: a producer id and per-queue sequence numbers make a resent append a
//! no-op answered with the original offsets, so retries never duplicate.
//!
//! Per (producer, queue) the server remembers the last [`RUNS_KEPT`] runs it stored (a run is
//! one request's consecutive messages for one queue: first sequence, count, first offset; a
//! queue's messages of one request get consecutive offsets). A request's run for a queue is
//! then one of: new (it starts right after the last sequence, or the pair is unknown), a
//! resend (every sequence already stored: answered from the runs), a gap (refused with
//! `SEQUENCE_GAP`, nothing stored) or too old (`SEQUENCE_TOO_OLD`).
//!
//! The runs are durable: each request that stores messages also appends one record to the
//! producer's own queue (`\0producer\0{id}`), after its data and acknowledged only once both are
//! durable; a producer's runs are loaded from that queue the first time it is seen after a
//! restart. The record lands in the same or the next group-commit round as the data, so the
//! one window left is a crash between those two rounds: a batch that was never acknowledged
//! may then be stored twice if resent after the restart.
//!
//! Bounds: at most [`PRODUCERS_MAX`] producers (the least recently used is forgotten first)
//! and [`QUEUES_PER_PRODUCER_MAX`] queues per producer; a forgotten pair accepts its next
//! sequence as new.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use levee_store::{CommitTicket, Store};

use levee_broker::names::{PRODUCER_ID_BYTES_MAX, producer_queue};

use crate::queue::{lock, storage_error, write_error};

/// Producers remembered at once.
pub const PRODUCERS_MAX: usize = 10_000;
/// Queues remembered per producer.
pub const QUEUES_PER_PRODUCER_MAX: usize = 100_000;
/// Runs remembered per (producer, queue): a resend of one of the last this-many requests that
/// touched the queue gets its original offsets.
pub const RUNS_KEPT: usize = 8;

/// One request's consecutive messages for one queue.
#[derive(Debug, Clone, Copy)]
struct Run {
    first_sequence: u64,
    count: u64,
    first_offset: u64,
    ticket: Option<CommitTicket>,
}

impl Run {
    fn last_sequence(&self) -> u64 {
        self.first_sequence + self.count - 1
    }
}

#[derive(Debug)]
struct ProducerState {
    queues: HashMap<Vec<u8>, VecDeque<Run>>,
    /// Order in which queues were first seen, for forgetting the oldest.
    queue_order: VecDeque<Vec<u8>>,
    last_used: u64,
    /// Whether every queue this producer ever stored to is remembered (nothing forgotten or
    /// trimmed away). Then a queue not remembered is new to the producer, and its first
    /// sequence must be 0: a higher one means an earlier batch has not arrived yet.
    complete: bool,
}

impl Default for ProducerState {
    fn default() -> Self {
        Self {
            queues: HashMap::new(),
            queue_order: VecDeque::new(),
            last_used: 0,
            complete: true,
        }
    }
}

impl ProducerState {
    fn record(&mut self, queue: &[u8], run: Run) {
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
}

/// Every idempotent producer's recent runs.
#[derive(Debug, Default)]
pub struct Producers {
    states: Mutex<HashMap<String, Arc<Mutex<ProducerState>>>>,
    clock: std::sync::atomic::AtomicU64,
    deduplicated: prometheus_client::metrics::counter::Counter,
}

/// What an idempotent append did.
#[derive(Debug)]
pub struct IdempotentAppend {
    /// Each message's offset, in request order.
    pub offsets: Vec<u64>,
    /// The ticket to wait for before answering (the highest of the new record's and the
    /// resent runs' rounds).
    pub ticket: Option<CommitTicket>,
    /// Whether this call stored each message (false: a resend, answered with the offset the
    /// first call stored it at, maybe with another payload).
    pub stored_now: Vec<bool>,
}

/// One message of an idempotent append: its queue, payload and sequence.
#[derive(Debug)]
pub struct SequencedMessage {
    /// The queue (a slice of the request, as the payload).
    pub queue: levee_proto::Bytes,
    /// The payload.
    pub payload: levee_proto::Bytes,
    /// The producer's sequence number on the queue.
    pub sequence: u64,
}

/// What a request's run for one queue is.
enum Verdict {
    New,
    Resend {
        first_offset: u64,
        ticket: Option<CommitTicket>,
    },
}

/// Checks a producer id: 1 to [`PRODUCER_ID_BYTES_MAX`] bytes.
pub fn check_producer_id(producer: &str) -> Result<(), WireError> {
    if producer.is_empty() || producer.len() > PRODUCER_ID_BYTES_MAX {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "producer_id must be 1 to {PRODUCER_ID_BYTES_MAX} bytes, got {}",
                producer.len()
            ),
        ));
    }
    Ok(())
}

/// Encodes runs: per queue, name length (u8), name, first sequence (u64), count (u64), first
/// offset (u64), little-endian.
fn encode_runs(runs: &[(&[u8], Run)]) -> Vec<u8> {
    let mut record = Vec::new();
    for (queue, run) in runs {
        record.push(u8::try_from(queue.len()).unwrap_or(u8::MAX));
        record.extend_from_slice(queue);
        record.extend_from_slice(&run.first_sequence.to_le_bytes());
        record.extend_from_slice(&run.count.to_le_bytes());
        record.extend_from_slice(&run.first_offset.to_le_bytes());
    }
    record
}

fn decode_runs(mut record: &[u8], mut each: impl FnMut(&[u8], Run)) {
    while let Some((&length, rest)) = record.split_first() {
        let length = usize::from(length);
        if rest.len() < length + 24 {
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
        if run.count > 0 {
            each(queue, run);
        }
        record = &rest[24..];
    }
}

impl Producers {
    /// No producers yet; resent messages are counted in `deduplicated`.
    pub fn new(deduplicated: prometheus_client::metrics::counter::Counter) -> Self {
        Self {
            deduplicated,
            ..Self::default()
        }
    }

    /// The producer's state, loaded from its queue the first time it is seen.
    fn state(&self, store: &Store, producer: &str) -> Result<Arc<Mutex<ProducerState>>, WireError> {
        let tick = self
            .clock
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut states = lock(&self.states);
        if let Some(state) = states.get(producer) {
            lock(state).last_used = tick;
            return Ok(Arc::clone(state));
        }
        if states.len() >= PRODUCERS_MAX
            && let Some(oldest) = states
                .iter()
                .min_by_key(|(_, state)| lock(state).last_used)
                .map(|(name, _)| name.clone())
        {
            states.remove(&oldest);
        }
        let mut state = ProducerState {
            last_used: tick,
            ..ProducerState::default()
        };
        let name = producer_queue(producer);
        if let Some(info) = store
            .queue_info(&name)
            .map_err(|error| storage_error(&error))?
        {
            let mut offset = info.first_offset;
            while offset < info.next_offset {
                let batch = store
                    .read(&name, offset, 1_000, 1 << 20)
                    .map_err(|error| storage_error(&error))?;
                if batch.is_empty() {
                    break;
                }
                for record in batch.iter() {
                    decode_runs(record, |queue, run| state.record(queue, run));
                }
                offset = batch.next_offset();
            }
        }
        let state = Arc::new(Mutex::new(state));
        states.insert(producer.to_owned(), Arc::clone(&state));
        Ok(state)
    }

    /// Appends `messages` for `producer`: new runs are stored, resent ones answered from
    /// memory.
    pub fn append(
        &self,
        store: &Store,
        producer: &str,
        messages: &[SequencedMessage],
    ) -> Result<IdempotentAppend, WireError> {
        check_producer_id(producer)?;
        // The request's runs: per queue, its messages' indexes in order.
        let mut by_queue: Vec<(&[u8], Vec<usize>)> = Vec::new();
        let mut position: HashMap<&[u8], usize> = HashMap::new();
        for (index, message) in messages.iter().enumerate() {
            let slot = *position.entry(&message.queue).or_insert_with(|| {
                by_queue.push((&message.queue, Vec::new()));
                by_queue.len() - 1
            });
            let run = &mut by_queue[slot].1;
            if let Some(&previous) = run.last()
                && messages[previous].sequence.checked_add(1) != Some(message.sequence)
            {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "queue '{}': sequences within one request must be consecutive, got {} \
                         after {}",
                        String::from_utf8_lossy(&message.queue),
                        message.sequence,
                        messages[previous].sequence
                    ),
                ));
            }
            run.push(index);
        }
        let state = self.state(store, producer)?;
        let mut state = lock(&state);
        let mut verdicts = Vec::with_capacity(by_queue.len());
        for (queue, indexes) in &by_queue {
            let first = messages[indexes[0]].sequence;
            let last = messages[indexes[indexes.len() - 1]].sequence;
            let runs = state.queues.get(*queue);
            verdicts.push(judge(runs, state.complete, queue, first, last)?);
        }
        // Store the new runs in one batch, then the producer's record after them.
        let mut batch: Vec<(&[u8], &[u8])> = Vec::new();
        for ((_, indexes), verdict) in by_queue.iter().zip(&verdicts) {
            if matches!(verdict, Verdict::New) {
                for &index in indexes {
                    batch.push((&messages[index].queue, &messages[index].payload));
                }
            }
        }
        let mut offsets = vec![0; messages.len()];
        let mut stored_now = vec![false; messages.len()];
        let mut tickets: Vec<CommitTicket> = Vec::new();
        if !batch.is_empty() {
            let (stored, ticket) = store.append_batch_deferred(&batch).map_err(write_error)?;
            let mut stored = stored.into_iter();
            let mut runs = Vec::new();
            for ((queue, indexes), verdict) in by_queue.iter().zip(&verdicts) {
                if !matches!(verdict, Verdict::New) {
                    continue;
                }
                for &index in indexes {
                    offsets[index] = stored.next().unwrap_or_default();
                    stored_now[index] = true;
                }
                let run = Run {
                    first_sequence: messages[indexes[0]].sequence,
                    count: indexes.len() as u64,
                    first_offset: offsets[indexes[0]],
                    ticket: Some(ticket),
                };
                runs.push((*queue, run));
            }
            let (_, record_ticket) = store
                .append_deferred(&producer_queue(producer), &encode_runs(&runs))
                .map_err(write_error)?;
            for (queue, run) in runs {
                state.record(
                    queue,
                    Run {
                        ticket: Some(record_ticket),
                        ..run
                    },
                );
            }
            tickets.push(record_ticket);
        }
        for ((_, indexes), verdict) in by_queue.iter().zip(&verdicts) {
            if let Verdict::Resend {
                first_offset,
                ticket,
            } = verdict
            {
                for (step, &index) in indexes.iter().enumerate() {
                    offsets[index] = first_offset + step as u64;
                }
                self.deduplicated.inc_by(indexes.len() as u64);
                tickets.extend(ticket);
            }
        }
        drop(state);
        Ok(IdempotentAppend {
            offsets,
            ticket: tickets.into_iter().max(),
            stored_now,
        })
    }
}

/// Judges a request's run `first..=last` of one queue against the remembered runs; `complete`
/// says whether every queue of the producer is remembered.
fn judge(
    runs: Option<&VecDeque<Run>>,
    complete: bool,
    queue: &[u8],
    first: u64,
    last: u64,
) -> Result<Verdict, WireError> {
    let name = || String::from_utf8_lossy(queue).into_owned();
    let Some(last_run) = runs.and_then(VecDeque::back) else {
        if complete && first != 0 {
            return Err(WireError::new(
                ErrorCode::SequenceGap,
                format!(
                    "queue '{}': sequence {first} skips ahead; this producer's first sequence on \
                     the queue is 0. Resend the missing messages first",
                    name()
                ),
            ));
        }
        return Ok(Verdict::New);
    };
    let expected = last_run.last_sequence() + 1;
    if first == expected {
        return Ok(Verdict::New);
    }
    if first > expected {
        return Err(WireError::new(
            ErrorCode::SequenceGap,
            format!(
                "queue '{}': sequence {first} skips ahead; the next expected is {expected}. \
                 Resend the missing messages first",
                name()
            ),
        ));
    }
    if last >= expected {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "queue '{}': sequences {first}..={last} mix stored ones (up to {}) with new \
                 ones; resend batches exactly as first sent",
                name(),
                expected - 1
            ),
        ));
    }
    let runs = runs.map(|runs| runs.iter()).into_iter().flatten();
    for run in runs {
        if run.first_sequence <= first && last <= run.last_sequence() {
            return Ok(Verdict::Resend {
                first_offset: run.first_offset + (first - run.first_sequence),
                ticket: run.ticket,
            });
        }
    }
    Err(WireError::new(
        ErrorCode::SequenceTooOld,
        format!(
            "queue '{}': sequences {first}..={last} were stored earlier than the last \
             {RUNS_KEPT} requests the server remembers; they were not stored again",
            name()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(queue: &[u8], sequences: std::ops::Range<u64>) -> Vec<SequencedMessage> {
        sequences
            .map(|sequence| SequencedMessage {
                queue: levee_proto::Bytes::copy_from_slice(queue),
                payload: sequence.to_le_bytes().to_vec().into(),
                sequence,
            })
            .collect()
    }

    /// Appends and waits for durability, as the service does.
    fn send(
        producers: &Producers,
        store: &Store,
        producer: &str,
        messages: &[SequencedMessage],
    ) -> Result<Vec<u64>, WireError> {
        let appended = producers.append(store, producer, messages)?;
        if let Some(ticket) = appended.ticket {
            store.wait_durable(ticket).unwrap();
        }
        assert_eq!(appended.stored_now.len(), messages.len());
        Ok(appended.offsets)
    }

    fn open(directory: &std::path::Path) -> Store {
        Store::open(directory, levee_store::StoreOptions::default())
            .unwrap()
            .0
    }

    #[test]
    fn given_resent_batch_then_original_offsets_and_nothing_stored_twice() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path());
        let producers = Producers::default();
        store.append(b"orders", b"someone else").unwrap();
        let first = send(&producers, &store, "p1", &messages(b"orders", 0..3)).unwrap();
        assert_eq!(first, vec![1, 2, 3]);
        store.append(b"orders", b"someone else again").unwrap();
        let again = send(&producers, &store, "p1", &messages(b"orders", 0..3)).unwrap();
        assert_eq!(again, first, "a resend answers with the original offsets");
        let part = send(&producers, &store, "p1", &messages(b"orders", 1..3)).unwrap();
        assert_eq!(part, vec![2, 3]);
        assert_eq!(store.queue_info(b"orders").unwrap().unwrap().next_offset, 5);
        let next = send(&producers, &store, "p1", &messages(b"orders", 3..4)).unwrap();
        assert_eq!(next, vec![5]);
    }

    #[test]
    fn given_a_batch_with_a_resent_run_then_only_the_new_run_is_marked_stored() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path());
        let producers = Producers::default();
        send(&producers, &store, "p1", &messages(b"orders", 0..2)).unwrap();
        let mut batch = messages(b"orders", 0..2);
        batch.extend(messages(b"invoices", 0..1));
        let appended = producers.append(&store, "p1", &batch).unwrap();
        assert_eq!(appended.offsets, vec![0, 1, 0]);
        assert_eq!(
            appended.stored_now,
            vec![false, false, true],
            "the resent run is answered, not stored"
        );
    }

    #[test]
    fn given_gap_or_mixed_run_then_refused_and_nothing_stored() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path());
        let producers = Producers::default();
        let early = send(&producers, &store, "p1", &messages(b"orders", 2..4)).unwrap_err();
        assert_eq!(
            early.code,
            ErrorCode::SequenceGap,
            "a new queue starts at 0"
        );
        send(&producers, &store, "p1", &messages(b"orders", 0..2)).unwrap();
        let gap = send(&producers, &store, "p1", &messages(b"orders", 3..4)).unwrap_err();
        assert_eq!(gap.code, ErrorCode::SequenceGap);
        assert!(gap.message.contains("next expected is 2"), "{gap}");
        let mixed = send(&producers, &store, "p1", &messages(b"orders", 1..3)).unwrap_err();
        assert_eq!(mixed.code, ErrorCode::InvalidArgument);
        let mut unordered = messages(b"orders", 2..4);
        unordered.swap(0, 1);
        assert!(send(&producers, &store, "p1", &unordered).is_err());
        assert_eq!(store.queue_info(b"orders").unwrap().unwrap().next_offset, 2);
    }

    #[test]
    fn given_many_later_batches_when_oldest_resent_then_too_old() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path());
        let producers = Producers::default();
        for sequence in 0..=(RUNS_KEPT as u64) {
            send(
                &producers,
                &store,
                "p1",
                &messages(b"q", sequence..sequence + 1),
            )
            .unwrap();
        }
        let error = send(&producers, &store, "p1", &messages(b"q", 0..1)).unwrap_err();
        assert_eq!(error.code, ErrorCode::SequenceTooOld);
        assert_eq!(
            send(&producers, &store, "p1", &messages(b"q", 1..2)).unwrap(),
            vec![1]
        );
    }

    #[test]
    fn given_restart_when_batch_resent_then_runs_were_loaded_from_the_store() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path());
        let mut batch = messages(b"a", 0..2);
        batch.extend(messages(b"b", 0..3));
        let first = send(&Producers::default(), &store, "p1", &batch).unwrap();
        store.close().unwrap();
        let store = open(directory.path());
        let producers = Producers::default();
        assert_eq!(send(&producers, &store, "p1", &batch).unwrap(), first);
        assert_eq!(store.queue_info(b"b").unwrap().unwrap().next_offset, 3);
        let gap = send(&producers, &store, "p1", &messages(b"b", 4..5)).unwrap_err();
        assert_eq!(gap.code, ErrorCode::SequenceGap);
    }
}
