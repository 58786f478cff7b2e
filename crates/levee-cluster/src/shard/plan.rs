//! Planning a batch of a shard's entries: what each entry appends to which queue at which
//! offset, and what it answers, decided from the entries and the queues' state before the
//! batch alone, so that every replica (and a restart finishing a batch) plans the same.
//!
//! Idempotent producers (`ShardCommand::Append` with a producer id): each request's runs are
//! judged by the broker engine's [`ProducerRuns`] (new, a resend answered with the original
//! offsets, or refused), and the new runs are recorded in the producer's own queue of the
//! shard (`\0producer\0`, the shard as 4 big-endian bytes, the id) in the same batch as the
//! messages, so the record is recovered exactly with them. A producer's runs are loaded from
//! that queue the first time the shard sees it after a start.

use std::collections::HashMap;

use levee_broker::delay::{DelayWheel, DelayedEntry, Placement, Slot, shard_slots_prefix};
use levee_broker::names::{PRODUCER_PREFIX, SHARD_DELETES_PREFIX};
use levee_broker::producer::{
    PRODUCERS_MAX, ProducerRuns, Run, SequenceError, Verdict, encode_runs, request_runs,
};
use levee_proto::Bytes;
use levee_store::{InputError, Store};

use crate::shard::{QueueMessage, RefusedCode, ShardId, ShardResponse};

/// Longest queue name the store takes.
const QUEUE_NAME_BYTES_MAX: usize = 255;
/// Most producer runs records read at once while loading a producer.
const LOAD_BATCH_MESSAGES: usize = 1_000;
/// One `ShardCommand::Deliver` takes whole due slots until its batch holds this many
/// messages; the due slots left are taken by the next one (proposed at once).
pub const DELIVER_MESSAGES_MAX: usize = 10_000;
/// ... or this many bytes.
pub const DELIVER_BYTES_MAX: usize = 16 << 20;
/// Most messages one read of a slot takes.
const SLOT_READ_MESSAGES: usize = 1_000;

/// The producer queue of `producer` in `shard`.
pub fn producer_queue(shard: ShardId, producer: &str) -> Bytes {
    let mut name = Vec::with_capacity(PRODUCER_PREFIX.len() + 4 + producer.len());
    name.extend_from_slice(PRODUCER_PREFIX);
    name.extend_from_slice(&shard.to_be_bytes());
    name.extend_from_slice(producer.as_bytes());
    Bytes::from(name)
}

/// The queue counting the deletes of `shard`'s queues (see
/// [`levee_broker::names::SHARD_DELETES_PREFIX`]).
pub fn deletes_queue(shard: ShardId) -> Bytes {
    let mut name = Vec::with_capacity(SHARD_DELETES_PREFIX.len() + 4);
    name.extend_from_slice(SHARD_DELETES_PREFIX);
    name.extend_from_slice(&shard.to_be_bytes());
    Bytes::from(name)
}

/// `shard`'s delete epoch in `store`: how many of its queues' deletes were applied here. A
/// consumer's position on a queue of the shard is stamped with it, so a position taken before
/// a delete loses to the delete's forget on every replica alike.
pub fn delete_epoch(store: &Store, shard: ShardId) -> u64 {
    next_offset(store, &deletes_queue(shard))
}

/// Why the store would refuse a message, if it would (checked the same way on every replica,
/// before anything of the entry is planned), in the store's own words, so a lone server and a
/// cluster refuse alike.
pub fn refusal(store: &Store, message: &QueueMessage) -> Option<String> {
    let max = store.options().message_bytes_max;
    if message.queue.is_empty() || message.queue.len() > QUEUE_NAME_BYTES_MAX {
        return Some(InputError::QueueName(message.queue.len()).to_string());
    }
    (message.payload.len() > max).then(|| {
        InputError::MessageTooLarge {
            length: message.payload.len(),
            max,
        }
        .to_string()
    })
}

/// The delay wheel of `shard`'s slots in `store`: the slot queues found, with what they hold,
/// over `taken` (the marks, see [`DelayWheel::taken_below`]).
pub fn shard_wheel(store: &Store, shard: ShardId, taken: (u64, u64)) -> DelayWheel {
    let mut wheel = DelayWheel::taken(taken.0, taken.1);
    let mut found = Vec::new();
    store.for_each_queue_with_prefix(&shard_slots_prefix(shard), |name| found.push(name.to_vec()));
    for name in found {
        if let (Some(slot), Ok(Some(info))) =
            (Slot::parse_shard(&name, shard), store.queue_info(&name))
        {
            wheel.restore(slot, info.next_offset - info.first_offset);
        }
    }
    wheel
}

/// A queue's next offset in the store (0 for one that does not exist).
pub fn next_offset(store: &Store, queue: &[u8]) -> u64 {
    store
        .queue_info(queue)
        .ok()
        .flatten()
        .map_or(0, |info| info.next_offset)
}

/// The idempotent producers a shard remembers (at most [`PRODUCERS_MAX`]; the least
/// recently used is forgotten first and loaded again from its queue when next seen).
#[derive(Debug, Default)]
pub struct ShardProducers {
    runs: HashMap<String, (ProducerRuns, u64)>,
    tick: u64,
}

impl ShardProducers {
    /// `producer`'s runs, loaded from its queue (the records below `limit`, if given) when not
    /// remembered.
    fn runs(
        &mut self,
        (store, shard): (&Store, ShardId),
        producer: &str,
        limit: Option<u64>,
    ) -> &mut ProducerRuns {
        self.tick += 1;
        let tick = self.tick;
        if !self.runs.contains_key(producer) {
            if self.runs.len() >= PRODUCERS_MAX
                && let Some(oldest) = self
                    .runs
                    .iter()
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(name, _)| name.clone())
            {
                self.runs.remove(&oldest);
            }
            let loaded = load(store, &producer_queue(shard, producer), limit);
            self.runs.insert(producer.to_owned(), (loaded, tick));
        }
        let (runs, used) = self
            .runs
            .get_mut(producer)
            .unwrap_or_else(|| unreachable!("inserted above"));
        *used = tick;
        runs
    }
}

/// A producer's runs from its queue's records below `limit`.
fn load(store: &Store, queue: &[u8], limit: Option<u64>) -> ProducerRuns {
    let mut runs = ProducerRuns::default();
    let Ok(Some(info)) = store.queue_info(queue) else {
        return runs;
    };
    let end = limit.map_or(info.next_offset, |limit| limit.min(info.next_offset));
    let mut offset = info.first_offset;
    while offset < end {
        let Ok(batch) = store.read(queue, offset, LOAD_BATCH_MESSAGES, 1 << 20) else {
            break;
        };
        if batch.is_empty() {
            break;
        }
        let first = batch.first_offset;
        for (index, record) in batch.iter().enumerate() {
            if first + index as u64 >= end {
                break;
            }
            runs.load_record(record);
        }
        offset = batch.next_offset();
    }
    runs
}

/// The refusal of a request's sequences.
fn sequence_refusal(error: &SequenceError) -> ShardResponse {
    let code = match error {
        SequenceError::FirstGap { .. } | SequenceError::Gap { .. } => RefusedCode::SequenceGap,
        SequenceError::TooOld { .. } => RefusedCode::SequenceTooOld,
        _ => RefusedCode::Invalid,
    };
    ShardResponse::Refused {
        code,
        reason: error.to_string(),
    }
}

/// A batch being planned.
pub struct Plan<'a> {
    store: &'a Store,
    shard: ShardId,
    /// A queue's offset before the batch.
    start_of: &'a dyn Fn(&[u8]) -> u64,
    /// Loading producers: the offset of its queue below which records count (a restart
    /// finishing a batch counts only those before it).
    producer_limit: &'a dyn Fn(&[u8]) -> Option<u64>,
    /// The messages to append, in order, with the offset each must get.
    pub batch: Vec<(Bytes, Bytes, u64)>,
    /// Each queue the batch touches: its offset before the batch and its next one.
    pub queues: HashMap<Bytes, (u64, u64)>,
}

impl std::fmt::Debug for Plan<'_> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "Plan({} messages)", self.batch.len())
    }
}

impl<'a> Plan<'a> {
    /// An empty plan for `shard` over `store`, the queues' state before it given by
    /// `start_of` and `producer_limit`.
    pub fn new(
        (store, shard): (&'a Store, ShardId),
        start_of: &'a dyn Fn(&[u8]) -> u64,
        producer_limit: &'a dyn Fn(&[u8]) -> Option<u64>,
    ) -> Self {
        Self {
            store,
            shard,
            start_of,
            producer_limit,
            batch: Vec::new(),
            queues: HashMap::new(),
        }
    }

    /// Adds one message; its offset.
    fn push(&mut self, queue: &Bytes, payload: Bytes) -> u64 {
        let start_of = self.start_of;
        let (_, next) = self.queues.entry(queue.clone()).or_insert_with(|| {
            let start = start_of(queue);
            (start, start)
        });
        let offset = *next;
        *next += 1;
        self.batch.push((queue.clone(), payload, offset));
        offset
    }

    /// Plans one `ShardCommand::Delay`: each entry placed by `wheel` as of `now_ms`, into
    /// its target when due, else into its slot's queue; what it answers (each entry's offset
    /// in its target, 0 when it waits). Refused whole when an entry is unreadable or a message
    /// of it one the store would refuse.
    pub fn delay(
        &mut self,
        wheel: &mut DelayWheel,
        now_ms: u64,
        entries: &[Bytes],
    ) -> ShardResponse {
        let mut decoded = Vec::with_capacity(entries.len());
        for (index, bytes) in entries.iter().enumerate() {
            let Some(entry) = DelayedEntry::decode(bytes) else {
                return ShardResponse::Refused {
                    code: RefusedCode::Invalid,
                    reason: format!("delayed entry {index} is not one (unreadable)"),
                };
            };
            // One due by the entry's clock goes to its target: checked as that message (as a
            // lone server checks it); any other as its slot's message, the larger of the two
            // it may become.
            let payload = if entry.due_ms <= now_ms {
                Bytes::from(entry.body.clone())
            } else {
                bytes.clone()
            };
            let message = QueueMessage {
                queue: Bytes::from(entry.target.clone()),
                payload,
                sequence: 0,
            };
            if let Some(reason) = refusal(self.store, &message) {
                return ShardResponse::Refused {
                    code: RefusedCode::Invalid,
                    reason,
                };
            }
            decoded.push(entry);
        }
        let offsets = decoded
            .into_iter()
            .zip(entries)
            .map(|(entry, bytes)| self.place(wheel, now_ms, entry, bytes.clone()).unwrap_or(0))
            .collect();
        ShardResponse::Appended { offsets }
    }

    /// Places one delayed entry (`bytes`, decoded as `entry`) as of `now_ms`: its offset in
    /// its target when appended at once, `None` when it waits in a slot.
    fn place(
        &mut self,
        wheel: &mut DelayWheel,
        now_ms: u64,
        entry: DelayedEntry,
        bytes: Bytes,
    ) -> Option<u64> {
        match wheel.place(entry.due_ms, now_ms) {
            Placement::Now => Some(self.push(&Bytes::from(entry.target), Bytes::from(entry.body))),
            Placement::Slot(slot) => {
                self.push(&Bytes::from(slot.shard_queue(self.shard)), bytes);
                None
            }
        }
    }

    /// Plans one `ShardCommand::Deliver` as of `now_ms`: takes the slots `wheel` says are
    /// due, then, slot by slot and page by page until the batch holds
    /// [`DELIVER_MESSAGES_MAX`] messages or [`DELIVER_BYTES_MAX`] bytes, places a coarse
    /// slot's entries again and appends a fine slot's entries' bodies to their targets. A slot
    /// cut short by the bounds is left in `partial` (its queue and the first offset not read;
    /// the next `Deliver` goes on from there), and it and the slots not reached are counted in
    /// `wheel` again (due: the next `Deliver` takes them, proposed at once). The slot queues
    /// read whole, to delete once the batch is durable, and the due time of each entry
    /// delivered to its target. Decided by the store's slots, `wheel` and `partial` alone, so
    /// every replica plans the same.
    pub fn deliver(
        &mut self,
        wheel: &mut DelayWheel,
        now_ms: u64,
        partial: &mut Option<(Bytes, u64)>,
    ) -> (Vec<Bytes>, Vec<u64>) {
        let due = wheel.take_due(now_ms);
        let slots = due
            .spread
            .iter()
            .map(|&number| Slot::Coarse(number))
            .chain(due.deliver.iter().map(|&number| Slot::Fine(number)));
        let (mut read, mut delivered) = (Vec::new(), Vec::new());
        let mut bytes = 0;
        for slot in slots {
            let queue = Bytes::from(slot.shard_queue(self.shard));
            let Ok(Some(info)) = self.store.queue_info(&queue) else {
                continue;
            };
            let mut offset = match partial {
                Some((resumed, offset)) if *resumed == queue => *offset,
                _ => info.first_offset,
            };
            while offset < info.next_offset
                && self.batch.len() < DELIVER_MESSAGES_MAX
                && bytes < DELIVER_BYTES_MAX
            {
                let Ok(page) = self.store.read(
                    &queue,
                    offset,
                    SLOT_READ_MESSAGES.min(DELIVER_MESSAGES_MAX - self.batch.len()),
                    DELIVER_BYTES_MAX - bytes,
                ) else {
                    break;
                };
                if page.is_empty() {
                    break;
                }
                offset = page.next_offset();
                for stored in page.iter() {
                    bytes += stored.len();
                    if let Some(due_ms) = self.deliver_one(wheel, now_ms, slot, stored) {
                        delivered.push(due_ms);
                    }
                }
            }
            if offset >= info.next_offset {
                if partial
                    .as_ref()
                    .is_some_and(|(resumed, _)| *resumed == queue)
                {
                    *partial = None;
                }
                read.push(queue);
            } else {
                // Cut short, or not reached: due again at once.
                wheel.restore(slot, info.next_offset - offset);
                if offset > info.first_offset {
                    *partial = Some((queue, offset));
                }
            }
        }
        (read, delivered)
    }

    /// One stored entry of a due `slot`: a coarse slot's placed again, a fine slot's body
    /// appended to its target. Its due time when it went to its target.
    fn deliver_one(
        &mut self,
        wheel: &mut DelayWheel,
        now_ms: u64,
        slot: Slot,
        stored: &[u8],
    ) -> Option<u64> {
        let Some(entry) = DelayedEntry::decode(stored) else {
            tracing::warn!(
                ?slot,
                shard = self.shard,
                "a delayed entry is unreadable; skipped"
            );
            return None;
        };
        let due_ms = entry.due_ms;
        let to_target = match slot {
            Slot::Coarse(_) => self
                .place(wheel, now_ms, entry, Bytes::copy_from_slice(stored))
                .is_some(),
            Slot::Fine(_) => {
                self.push(&Bytes::from(entry.target), Bytes::from(entry.body));
                true
            }
        };
        to_target.then_some(due_ms)
    }

    /// Plans one append; what it answers.
    pub fn append(
        &mut self,
        producers: &mut ShardProducers,
        producer: Option<&str>,
        messages: &[QueueMessage],
    ) -> ShardResponse {
        if let Some(reason) = messages
            .iter()
            .find_map(|message| refusal(self.store, message))
        {
            return ShardResponse::Refused {
                code: RefusedCode::Invalid,
                reason,
            };
        }
        let Some(producer) = producer else {
            let offsets = messages
                .iter()
                .map(|message| self.push(&message.queue, message.payload.clone()))
                .collect();
            return ShardResponse::Appended { offsets };
        };
        let request = match request_runs(
            messages
                .iter()
                .map(|message| (&message.queue[..], message.sequence)),
        ) {
            Ok(request) => request,
            Err(error) => return sequence_refusal(&error),
        };
        let queue = producer_queue(self.shard, producer);
        let limit = (self.producer_limit)(&queue);
        let runs = producers.runs((self.store, self.shard), producer, limit);
        let verdicts = match request
            .iter()
            .map(|run| runs.judge(run.queue, run.first, run.last))
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(verdicts) => verdicts,
            Err(error) => return sequence_refusal(&error),
        };
        let mut offsets = vec![0; messages.len()];
        let mut new_runs = Vec::new();
        for (run, verdict) in request.iter().zip(verdicts) {
            match verdict {
                Verdict::New => {
                    for &index in &run.indexes {
                        offsets[index] =
                            self.push(&messages[index].queue, messages[index].payload.clone());
                    }
                    let first = run.indexes[0];
                    new_runs.push((
                        run.queue,
                        Run {
                            first_sequence: messages[first].sequence,
                            count: run.indexes.len() as u64,
                            first_offset: offsets[first],
                            ticket: None,
                        },
                    ));
                }
                Verdict::Resend { first_offset, .. } => {
                    for (position, &index) in run.indexes.iter().enumerate() {
                        offsets[index] = first_offset + position as u64;
                    }
                }
            }
        }
        if !new_runs.is_empty() {
            self.push(&queue, Bytes::from(encode_runs(&new_runs)));
            for (queue, run) in new_runs {
                runs.record(queue, run);
            }
        }
        ShardResponse::Appended { offsets }
    }
}
