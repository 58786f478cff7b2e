//! Idempotent producers over the store: the broker engine's [`ProducerRuns`] judges each
//! request's runs (new, a resend answered with the original offsets, or refused with
//! `SEQUENCE_GAP`, `SEQUENCE_TOO_OLD` or `INVALID_ARGUMENT`); this module keeps every
//! producer's runs in memory and in the store.
//!
//! The runs are durable: each request that stores messages also appends one record to the
//! producer's own queue (`\0producer\0{id}`), after its data and acknowledged only once both are
//! durable; a producer's runs are loaded from that queue the first time it is seen after a
//! restart. The record lands in the same or the next group-commit round as the data, so the
//! one window left is a crash between those two rounds: a batch that was never acknowledged
//! may then be stored twice if resent after the restart.
//!
//! Bounds: at most [`PRODUCERS_MAX`] producers (the least recently used is forgotten first);
//! the engine bounds the queues and runs remembered per producer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use levee_store::{CommitTicket, Store};

use levee_broker::names::{PRODUCER_ID_BYTES_MAX, producer_queue};
use levee_broker::producer::{
    PRODUCERS_MAX, ProducerRuns, Run, SequenceError, Verdict, encode_runs, request_runs,
};

use crate::queue::{lock, storage_error, write_error};

/// One producer's runs and when it was last used.
#[derive(Debug, Default)]
struct ProducerState {
    runs: ProducerRuns,
    last_used: u64,
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
                    state.runs.load_record(record);
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
        let by_queue = request_runs(
            messages
                .iter()
                .map(|message| (&message.queue[..], message.sequence)),
        )
        .map_err(|error| sequence_error(&error))?;
        let state = self.state(store, producer)?;
        let mut state = lock(&state);
        let verdicts = by_queue
            .iter()
            .map(|run| state.runs.judge(run.queue, run.first, run.last))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| sequence_error(&error))?;
        // Store the new runs in one batch, then the producer's record after them.
        let mut batch: Vec<(&[u8], &[u8])> = Vec::new();
        for (run, verdict) in by_queue.iter().zip(&verdicts) {
            if matches!(verdict, Verdict::New) {
                for &index in &run.indexes {
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
            for (request_run, verdict) in by_queue.iter().zip(&verdicts) {
                if !matches!(verdict, Verdict::New) {
                    continue;
                }
                let indexes = &request_run.indexes;
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
                runs.push((request_run.queue, run));
            }
            let (_, record_ticket) = store
                .append_deferred(&producer_queue(producer), &encode_runs(&runs))
                .map_err(write_error)?;
            for (queue, run) in runs {
                state.runs.record(
                    queue,
                    Run {
                        ticket: Some(record_ticket),
                        ..run
                    },
                );
            }
            tickets.push(record_ticket);
        }
        for (run, verdict) in by_queue.iter().zip(&verdicts) {
            if let Verdict::Resend {
                first_offset,
                ticket,
            } = verdict
            {
                let indexes = &run.indexes;
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

/// A refused request's sequences as a wire error.
fn sequence_error(error: &SequenceError) -> WireError {
    let code = match error {
        SequenceError::FirstGap { .. } | SequenceError::Gap { .. } => ErrorCode::SequenceGap,
        SequenceError::TooOld { .. } => ErrorCode::SequenceTooOld,
        _ => ErrorCode::InvalidArgument,
    };
    WireError::new(code, error.to_string())
}

#[cfg(test)]
mod tests {
    use levee_broker::producer::RUNS_KEPT;

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
