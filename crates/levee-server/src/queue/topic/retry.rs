//! When a consumer fails a message. A member's outcome (retry or reject) is judged by the
//! broker's [`RetryPolicy`]: the message, read back from its partition or retry queue, travels
//! on as a [`RetryRecord`] (attempts, history) either into the [`Delayer`](crate::queue::delay)
//! with the group's partition retry queue as its target, or into the group's dead-letter queue
//! `\0dlq\0{group}\0{topic}`; the member is answered once that is durable. Dead letters are
//! listed and redriven (back into the retry queues, attempts from 0); a redriven dead letter's
//! offset is logged in `\0dlx\0{group}\0{topic}` so lists skip it, and a redrive of all of them
//! deletes both queues. Offset resets move a group's committed offsets (replay, skip).

use std::collections::BTreeSet;
use std::sync::Arc;

use levee_broker::delay::DelayedEntry;
use levee_broker::names::{
    check_group_name, check_group_on_topic, dead_letter_queue, redriven_queue, retry_queue,
};
use levee_broker::retry::{Next, RetryPolicy, RetryRecord, check_delay};
use levee_proto::WireError;
use levee_proto::v1::reset_group_offsets_request::To;
use levee_proto::v1::{
    DeadLetter, ErrorCode, Failure, ListDeadLettersRequest, ListDeadLettersResponse,
    MessageOutcome, OutcomeAction, OutcomeResult, PartitionReset, ResetGroupOffsetsRequest,
    ResetGroupOffsetsResponse,
};
use levee_store::{CommitTicket, Store};

use crate::metrics::GroupLabels;
use crate::queue::delay::{Scheduled, unix_ms};
use crate::queue::replicated::{Lead, Replication};
use crate::queue::topic::catalog::Topic;
use crate::queue::topic::consume::ConsumeContext;
use crate::queue::topic::group::{Logged, Membership};
use crate::queue::{invalid, lock, name_error, storage_error, write_error};

/// Most outcomes in one outcome batch.
pub const OUTCOMES_PER_BATCH_MAX: usize = 1_024;
/// Outcome batches of one stream waiting to be durable at once; the stream waits for one to
/// settle before it judges more (back-pressure).
pub const OUTCOME_BATCHES_IN_FLIGHT_MAX: usize = 16;
/// Most dead letters one list answers.
pub const DEAD_LETTERS_PER_LIST_MAX: u32 = 1_000;
/// Dead letters a list answers when it does not say.
pub const DEAD_LETTERS_PER_LIST_DEFAULT: u32 = 100;
/// Most offsets one redrive names.
pub const REDRIVE_OFFSETS_MAX: usize = 10_000;
/// Messages one read of a dead-letter queue takes.
const DEAD_LETTER_READ_MESSAGES: usize = 1_000;
/// Bytes one read of a dead-letter queue takes.
const DEAD_LETTER_READ_BYTES: usize = 4 << 20;

/// Where a judged outcome sends its message.
enum Moved {
    Retry(DelayedEntry),
    Dead(Vec<u8>),
}

/// The message `outcome` names, as the record it travels on in.
fn record_of(
    store: &Store,
    group: &str,
    topic: &Topic,
    outcome: &MessageOutcome,
) -> Result<RetryRecord, WireError> {
    let queue = if outcome.retry {
        retry_queue(group, &topic.name, outcome.partition)
    } else {
        topic.queues[outcome.partition as usize].clone()
    };
    let batch = store
        .read(&queue, outcome.offset, 1, usize::MAX)
        .map_err(|error| storage_error(&error))?;
    let bytes = match batch.iter().next() {
        Some(bytes) if batch.first_offset == outcome.offset => bytes,
        _ => {
            return Err(WireError::new(
                ErrorCode::NotFound,
                format!(
                    "partition {}{}: offset {} is not in the queue (past its end, or removed \
                     by retention); report outcomes only for delivered messages",
                    outcome.partition,
                    if outcome.retry { " (retry queue)" } else { "" },
                    outcome.offset
                ),
            ));
        }
    };
    let first = || RetryRecord::first(outcome.partition, outcome.offset, bytes.to_vec());
    if outcome.retry {
        // A record that does not decode is kept whole as the payload.
        Ok(RetryRecord::decode(bytes).unwrap_or_else(first))
    } else {
        Ok(first())
    }
}

/// Judges one outcome at `now_ms` under `policy`.
fn judge_one(
    context: &ConsumeContext,
    membership: &Membership,
    (group, topic): (&str, &Topic),
    policy: &RetryPolicy,
    outcome: &MessageOutcome,
    now_ms: u64,
) -> Result<Moved, WireError> {
    let rejected = match OutcomeAction::try_from(outcome.action) {
        Ok(OutcomeAction::Retry) => false,
        Ok(OutcomeAction::Reject) => true,
        _ => {
            return Err(invalid(format!(
                "action {} is not one: send OUTCOME_ACTION_RETRY or OUTCOME_ACTION_REJECT",
                outcome.action
            )));
        }
    };
    let delay_ms = match outcome.delay_ms {
        0 => None,
        delay_ms => {
            check_delay(delay_ms).map_err(|error| invalid(error.to_string()))?;
            Some(delay_ms)
        }
    };
    lock(&membership.group)
        .state
        .check_commit(&membership.member, outcome.partition, outcome.epoch)
        .map_err(|error| crate::queue::group_error(group, &error))?;
    let mut record = record_of(&context.calls.store, group, topic, outcome)?;
    record.fail(now_ms, &outcome.error);
    Ok(
        match policy.after_failure(record.attempts, rejected, delay_ms) {
            Next::Retry { delay_ms } => {
                record.due_ms = now_ms.saturating_add(delay_ms);
                Moved::Retry(DelayedEntry {
                    due_ms: record.due_ms,
                    topic: topic.name.clone(),
                    target: retry_queue(group, &topic.name, outcome.partition),
                    body: record.encode(),
                })
            }
            Next::Dead => {
                record.due_ms = now_ms;
                Moved::Dead(record.encode())
            }
        },
    )
}

/// A batch of outcomes judged, its moves buffered: [`Judged::settle`] waits until they are
/// durable and gives the answers.
#[derive(Debug)]
pub struct Judged {
    results: Vec<OutcomeResult>,
    group: String,
    retries: u64,
    dead: u64,
    /// The buffered moves, or why buffering them failed.
    buffered: Result<Buffered, WireError>,
}

/// What [`buffer_moves`] buffered.
#[derive(Debug)]
struct Buffered {
    /// The retries.
    scheduled: Scheduled,
    /// What makes the dead letters durable here.
    dead_ticket: Option<CommitTicket>,
    /// In a cluster that replicates its queues: the dead letters (queue, record), to append
    /// through the topic's shard.
    dead_through_shards: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Judges a member's outcomes and buffers each accepted message's move into the retry path
/// or the dead letters (no waiting: the stream goes on while [`Judged::settle`] waits).
pub fn judge(
    context: &ConsumeContext,
    membership: &Membership,
    outcomes: &[MessageOutcome],
) -> Judged {
    let now = unix_ms();
    let (group, topic) = {
        let locked = lock(&membership.group);
        (locked.name().to_owned(), Arc::clone(&locked.topic))
    };
    let (policy, _) = context.topics.retry_policy(&group);
    let mut results = Vec::with_capacity(outcomes.len());
    let (mut retries, mut dead) = (Vec::new(), Vec::new());
    for outcome in outcomes {
        let mut result = OutcomeResult {
            partition: outcome.partition,
            offset: outcome.offset,
            retry: outcome.retry,
            ..OutcomeResult::default()
        };
        match judge_one(context, membership, (&group, &topic), &policy, outcome, now) {
            Ok(Moved::Retry(entry)) => {
                result.due_ms = entry.due_ms;
                retries.push(entry);
            }
            Ok(Moved::Dead(record)) => {
                result.dead_lettered = true;
                dead.push(record);
            }
            Err(error) => {
                result.code = error.code as i32;
                result.message = error.message;
            }
        }
        results.push(result);
    }
    let buffered = buffer_moves(context, (&group, &topic.name), &retries, &dead, now);
    Judged {
        results,
        group,
        retries: retries.len() as u64,
        dead: dead.len() as u64,
        buffered,
    }
}

impl Judged {
    /// Waits until the moves are durable, wakes the topic, counts them and returns the
    /// answers (a failed write refuses every outcome it held).
    pub async fn settle(mut self, context: &ConsumeContext) -> Vec<OutcomeResult> {
        let settled = match self.buffered {
            Ok(buffered) => {
                let Buffered {
                    scheduled,
                    dead_ticket,
                    dead_through_shards,
                } = buffered;
                let durable = async {
                    context.calls.durable(scheduled.ticket).await?;
                    context.calls.durable(dead_ticket).await?;
                    let delayer = &context.delayer;
                    delayer
                        .append_through_shards(scheduled.through_shards)
                        .await?;
                    if !dead_through_shards.is_empty() {
                        // Serialised with redrives of the dead letters.
                        let _writing = context.dead_letters_through_shards.lock().await;
                        Replication::append_records(
                            Some(&context.replication),
                            dead_through_shards,
                        )
                        .await?;
                    }
                    Ok::<_, WireError>(())
                };
                durable.await.map(|()| scheduled.topics)
            }
            Err(error) => Err(error),
        };
        match settled {
            Ok(topics) => {
                if self.retries > 0 {
                    // Retries due at once are in their retry queues now.
                    context.delayer.retries_visible();
                }
                for topic in &topics {
                    context
                        .waiters
                        .wake(&crate::queue::topic::consume::topic_wake_key(topic));
                }
                let labels = GroupLabels::new(&self.group);
                let metrics = &context.metrics;
                metrics
                    .group_retries_scheduled
                    .get_or_create(&labels)
                    .inc_by(self.retries);
                metrics
                    .group_dead_lettered
                    .get_or_create(&labels)
                    .inc_by(self.dead);
            }
            Err(error) => {
                for result in self.results.iter_mut().filter(|result| result.code == 0) {
                    result.code = error.code as i32;
                    result.message.clone_from(&error.message);
                    result.dead_lettered = false;
                    result.due_ms = 0;
                }
            }
        }
        self.results
    }
}

/// Buffers the retries and the dead letters (in a cluster that replicates its queues, hands
/// the dead letters back, to go through the topic's shard); returns what makes them durable.
fn buffer_moves(
    context: &ConsumeContext,
    (group, topic): (&str, &str),
    retries: &[DelayedEntry],
    dead: &[Vec<u8>],
    now_ms: u64,
) -> Result<Buffered, WireError> {
    let scheduled = context.delayer.schedule(retries, now_ms)?;
    let mut buffered = Buffered {
        scheduled,
        dead_ticket: None,
        dead_through_shards: Vec::new(),
    };
    if dead.is_empty() {
        return Ok(buffered);
    }
    let queue = dead_letter_queue(group, topic);
    if context.replication.groups().is_some() {
        buffered.dead_through_shards = dead
            .iter()
            .map(|record| (queue.clone(), record.clone()))
            .collect();
        return Ok(buffered);
    }
    let batch: Vec<(&[u8], &[u8])> = dead
        .iter()
        .map(|record| (queue.as_slice(), record.as_slice()))
        .collect();
    let _writing = lock(&context.dead_letters);
    let (_, ticket) = context
        .calls
        .store
        .append_batch_deferred(&batch)
        .map_err(write_error)?;
    buffered.dead_ticket = Some(ticket);
    Ok(buffered)
}

/// The offsets of the group's redriven dead letters (their log read whole).
fn redriven(store: &Store, queue: &[u8]) -> Result<BTreeSet<u64>, WireError> {
    let mut offsets = BTreeSet::new();
    let Some(info) = store
        .queue_info(queue)
        .map_err(|error| storage_error(&error))?
    else {
        return Ok(offsets);
    };
    let mut at = info.first_offset;
    while at < info.next_offset {
        let batch = store
            .read(queue, at, DEAD_LETTER_READ_MESSAGES, DEAD_LETTER_READ_BYTES)
            .map_err(|error| storage_error(&error))?;
        if batch.is_empty() {
            break;
        }
        at = batch.next_offset();
        for record in batch.iter() {
            offsets.extend(record.chunks_exact(8).map(|bytes| {
                let mut offset = [0; 8];
                offset.copy_from_slice(bytes);
                u64::from_le_bytes(offset)
            }));
        }
    }
    Ok(offsets)
}

/// A dead letter as the API gives it.
fn to_dead_letter(offset: u64, record: RetryRecord) -> DeadLetter {
    DeadLetter {
        offset,
        partition: record.partition,
        original_offset: record.offset,
        attempts: record.attempts,
        history: record
            .history
            .into_iter()
            .map(|failure| Failure {
                at_ms: failure.at_ms,
                error: failure.error,
            })
            .collect(),
        dead_at_ms: record.due_ms,
        payload: record.payload,
    }
}

/// Checks a group on a topic and finds the topic.
async fn group_topic(
    context: &ConsumeContext,
    group: &str,
    topic: &str,
) -> Result<Arc<Topic>, WireError> {
    check_group_on_topic(group, topic).map_err(|error| name_error(&error))?;
    context.topics.require_current(topic).await
}

/// Reads a group's dead letters (see `ListDeadLetters` in proto/levee/v1/topic.proto).
pub async fn list_dead_letters(
    context: &ConsumeContext,
    request: ListDeadLettersRequest,
) -> Result<ListDeadLettersResponse, WireError> {
    let topic = group_topic(context, &request.group, &request.topic).await?;
    let wanted = match request.max_messages {
        0 => DEAD_LETTERS_PER_LIST_DEFAULT,
        wanted if wanted <= DEAD_LETTERS_PER_LIST_MAX => wanted,
        wanted => {
            return Err(invalid(format!(
                "max_messages must be 1 to {DEAD_LETTERS_PER_LIST_MAX} (0 for \
                 {DEAD_LETTERS_PER_LIST_DEFAULT}), got {wanted}"
            )));
        }
    } as usize;
    let (group, from) = (request.group, request.from_offset);
    context
        .calls
        .run(move |store| {
            let queue = dead_letter_queue(&group, &topic.name);
            let skipped = redriven(store, &redriven_queue(&group, &topic.name))?;
            let end = store
                .queue_info(&queue)
                .map_err(|error| storage_error(&error))?
                .map_or(0, |info| info.next_offset);
            let mut answer = ListDeadLettersResponse {
                end_offset: end,
                next_offset: from.min(end),
                ..ListDeadLettersResponse::default()
            };
            // At most 100 reads, so a long run of redriven ones cannot hold the call.
            for _ in 0..100 {
                if answer.dead_letters.len() >= wanted || answer.next_offset >= end {
                    break;
                }
                let batch = store
                    .read(
                        &queue,
                        answer.next_offset,
                        wanted - answer.dead_letters.len(),
                        DEAD_LETTER_READ_BYTES,
                    )
                    .map_err(|error| storage_error(&error))?;
                if batch.is_empty() {
                    break;
                }
                let first = batch.first_offset;
                answer.next_offset = batch.next_offset();
                for (bytes, offset) in batch.iter().zip(first..) {
                    if skipped.contains(&offset) {
                        continue;
                    }
                    let record = RetryRecord::decode(bytes)
                        .unwrap_or_else(|| RetryRecord::first(0, 0, bytes.to_vec()));
                    answer.dead_letters.push(to_dead_letter(offset, record));
                }
            }
            Ok(answer)
        })
        .await
}

/// The dead letters a redrive takes: (offset, record) of each, every one not redriven when
/// `offsets` is `None`. Blocks on the store.
fn redrive_targets(
    store: &Store,
    (queue, skipped): (&[u8], &BTreeSet<u64>),
    offsets: Option<&[u64]>,
) -> Result<Vec<(u64, RetryRecord)>, WireError> {
    let Some(info) = store
        .queue_info(queue)
        .map_err(|error| storage_error(&error))?
    else {
        return match offsets.and_then(|offsets| offsets.first()) {
            Some(offset) => Err(no_dead_letter(*offset)),
            None => Ok(Vec::new()),
        };
    };
    let read = |from: u64, count: usize| {
        store
            .read(queue, from, count, DEAD_LETTER_READ_BYTES)
            .map_err(|error| storage_error(&error))
    };
    let mut targets = Vec::new();
    let decode = |bytes: &[u8]| {
        RetryRecord::decode(bytes).ok_or_else(|| {
            WireError::new(
                ErrorCode::StorageFailed,
                "a dead letter is unreadable (not a retry record); it cannot be redriven",
            )
        })
    };
    if let Some(offsets) = offsets {
        let mut seen = BTreeSet::new();
        for &offset in offsets {
            if !(info.first_offset..info.next_offset).contains(&offset)
                || skipped.contains(&offset)
                || !seen.insert(offset)
            {
                return Err(no_dead_letter(offset));
            }
            let batch = read(offset, 1)?;
            match batch.iter().next() {
                Some(bytes) if batch.first_offset == offset => {
                    targets.push((offset, decode(bytes)?));
                }
                _ => return Err(no_dead_letter(offset)),
            }
        }
    } else {
        let mut at = info.first_offset;
        while at < info.next_offset {
            let batch = read(at, DEAD_LETTER_READ_MESSAGES)?;
            if batch.is_empty() {
                break;
            }
            let first = batch.first_offset;
            at = batch.next_offset();
            for (bytes, offset) in batch.iter().zip(first..) {
                if !skipped.contains(&offset) {
                    targets.push((offset, decode(bytes)?));
                }
            }
        }
    }
    Ok(targets)
}

fn no_dead_letter(offset: u64) -> WireError {
    WireError::new(
        ErrorCode::NotFound,
        format!(
            "dead letter {offset} does not exist (never one, redriven already, or given twice); \
             list them with `levee group dead-letters` and redrive those listed"
        ),
    )
}

/// Puts dead letters back into the retry path (see `RedriveDeadLetters` in
/// proto/levee/v1/topic.proto); returns how many. In a cluster that replicates its queues
/// (the coordinator's `lead`), the marks, deletes and retries go through the topic's shard.
pub async fn redrive(
    context: &Arc<ConsumeContext>,
    (group, topic): (String, String),
    (offsets, all): (Vec<u64>, bool),
    lead: Option<Lead>,
) -> Result<u64, WireError> {
    let topic = group_topic(context, &group, &topic).await?;
    if all != offsets.is_empty() {
        return Err(invalid(
            "name the dead letters to redrive in offsets, or set all (not both)".to_owned(),
        ));
    }
    if offsets.len() > REDRIVE_OFFSETS_MAX {
        return Err(invalid(format!(
            "a redrive names at most {REDRIVE_OFFSETS_MAX} offsets, got {}; send several",
            offsets.len()
        )));
    }
    let labels = GroupLabels::new(&group);
    let topic_name = topic.name.clone();
    let redriven = if let Some(lead) = lead {
        redrive_through_shard(context, (&group, &topic), (offsets, all), &lead).await?
    } else {
        let shared = Arc::clone(context);
        context
            .calls
            .run(move |store| redrive_here(&shared, store, (&group, &topic), (&offsets, all)))
            .await?
    };
    context
        .metrics
        .group_redriven
        .get_or_create(&labels)
        .inc_by(redriven);
    context
        .waiters
        .wake(&crate::queue::topic::consume::topic_wake_key(&topic_name));
    Ok(redriven)
}

/// The dead letters a redrive takes (offset, record).
type RedriveTargets = Vec<(u64, RetryRecord)>;

/// The dead letters a redrive takes, and their retries (due now).
fn redrive_entries(
    store: &Store,
    (group, topic): (&str, &Topic),
    (offsets, all): (&[u64], bool),
) -> Result<(RedriveTargets, Vec<DelayedEntry>), WireError> {
    let queue = dead_letter_queue(group, &topic.name);
    let skipped = redriven(store, &redriven_queue(group, &topic.name))?;
    let targets = redrive_targets(store, (&queue, &skipped), (!all).then_some(offsets))?;
    let now = unix_ms();
    let entries = targets
        .iter()
        .map(|(_, record)| {
            let mut record = record.clone();
            record.attempts = 0;
            record.due_ms = now;
            DelayedEntry {
                due_ms: now,
                topic: topic.name.clone(),
                target: retry_queue(group, &topic.name, record.partition),
                body: record.encode(),
            }
        })
        .collect();
    Ok((targets, entries))
}

/// The marks of redriven dead letters' offsets (one record).
fn redrive_mark(targets: &[(u64, RetryRecord)]) -> Vec<u8> {
    targets
        .iter()
        .flat_map(|(offset, _)| offset.to_le_bytes())
        .collect()
}

/// [`redrive`] on a server whose queues are not replicated (blocks on the store).
fn redrive_here(
    context: &ConsumeContext,
    store: &Store,
    (group, topic): (&str, &Topic),
    (offsets, all): (&[u64], bool),
) -> Result<u64, WireError> {
    let queue = dead_letter_queue(group, &topic.name);
    let marks = redriven_queue(group, &topic.name);
    let _writing = lock(&context.dead_letters);
    let (targets, entries) = redrive_entries(store, (group, topic), (offsets, all))?;
    context.delayer.schedule(&entries, unix_ms())?;
    if !all {
        store
            .append_deferred(&marks, &redrive_mark(&targets))
            .map_err(write_error)?;
    }
    store.flush().map_err(write_error)?;
    context.delayer.retries_visible();
    if all {
        store.delete_queue(&queue).map_err(write_error)?;
        store.delete_queue(&marks).map_err(write_error)?;
    }
    Ok(targets.len() as u64)
}

/// [`redrive`] by the coordinator of a replicated cluster: the retries appended through the
/// topic's shard, then the marks of every redriven letter through it.
async fn redrive_through_shard(
    context: &Arc<ConsumeContext>,
    (group, topic): (&str, &Arc<Topic>),
    (offsets, all): (Vec<u64>, bool),
    lead: &Lead,
) -> Result<u64, WireError> {
    lead.settle().await?;
    let _writing = context.dead_letters_through_shards.lock().await;
    let shared = Arc::clone(context);
    let (group_name, read_topic) = (group.to_owned(), Arc::clone(topic));
    let (targets, scheduled) = context
        .calls
        .run(move |store| {
            let (targets, entries) =
                redrive_entries(store, (&group_name, &read_topic), (&offsets, all))?;
            let scheduled = shared.delayer.schedule(&entries, unix_ms())?;
            Ok((targets, scheduled))
        })
        .await?;
    context.calls.durable(scheduled.ticket).await?;
    context
        .delayer
        .append_through_shards(scheduled.through_shards)
        .await?;
    // Every redriven letter is marked, `all` too (the queues stay: a shard deletes no
    // server-owned queue), a bounded record at a time.
    let marks = redriven_queue(group, &topic.name);
    let records = targets
        .chunks(REDRIVE_OFFSETS_MAX)
        .map(|chunk| (marks.clone(), redrive_mark(chunk)))
        .collect();
    Replication::append_records(Some(&context.replication), records).await?;
    Ok(targets.len() as u64)
}

/// Sets `group`'s retry policy (`None`: the default), durably.
pub async fn set_policy(
    context: &ConsumeContext,
    group: &str,
    policy: Option<RetryPolicy>,
) -> Result<(), WireError> {
    check_group_name(group).map_err(|error| name_error(&error))?;
    context.topics.set_retry_policy(group, policy).await
}

/// Where a reset puts one partition: the offset asked for, given its first retained and next
/// offsets; `None` when it is past the end.
fn reset_target(store: &Store, queue: &[u8], to: &To) -> Result<(u64, u64, u64), WireError> {
    let info = store
        .queue_info(queue)
        .map_err(|error| storage_error(&error))?;
    let (first, next) = info.map_or((0, 0), |info| (info.first_offset, info.next_offset));
    let target = match *to {
        To::Earliest(_) => first,
        To::Latest(_) => next,
        To::Offset(offset) => offset,
        To::TimestampMs(timestamp_ms) => store
            .offset_at_time(queue, timestamp_ms)
            .map_err(|error| storage_error(&error))?
            .unwrap_or(0),
    };
    Ok((target, first, next))
}

/// Sets a group's committed offsets (see `ResetGroupOffsets` in proto/levee/v1/topic.proto);
/// as the coordinator of a replicated cluster (`lead`), through the topic's shard.
pub async fn reset_offsets(
    context: &Arc<ConsumeContext>,
    request: ResetGroupOffsetsRequest,
    lead: Option<Lead>,
) -> Result<ResetGroupOffsetsResponse, WireError> {
    let topic = group_topic(context, &request.group, &request.topic).await?;
    let Some(to) = request.to else {
        return Err(invalid(
            "say where to: earliest, latest, an offset or a timestamp_ms".to_owned(),
        ));
    };
    let partitions: Vec<u32> = if request.partitions.is_empty() {
        (0..topic.partitions()).collect()
    } else {
        request.partitions.clone()
    };
    if let Some(bad) = partitions.iter().find(|&&p| p >= topic.partitions()) {
        return Err(invalid(format!(
            "partition {bad} does not exist; topic '{}' has {} partitions",
            topic.name,
            topic.partitions()
        )));
    }
    if let Some(lead) = &lead {
        lead.settle().await?;
    }
    let term = lead.as_ref().map_or(0, |lead| lead.term);
    let handle = {
        let (shared, group, topic) = (
            Arc::clone(context),
            request.group.clone(),
            Arc::clone(&topic),
        );
        context
            .calls
            .run(move |store| shared.groups.group(store, &group, &topic, term))
            .await?
    };
    // Through the shard, one snapshot at a time per group (in the order taken).
    let turn = lock(&handle).turn();
    let _turn = match &lead {
        Some(_) => Some(turn.lock().await),
        None => None,
    };
    let (log_here, force) = (lead.is_none(), request.force);
    let group = Arc::clone(&handle);
    let (answer, logged) = context
        .calls
        .run(move |store| {
            let mut resets = Vec::with_capacity(partitions.len());
            let mut offsets = Vec::with_capacity(partitions.len());
            for &partition in &partitions {
                let queue = &topic.queues[partition as usize];
                let (target, first, next) = reset_target(store, queue, &to)?;
                if target > next {
                    return Err(WireError::new(
                        ErrorCode::OffsetOutOfRange,
                        format!(
                            "partition {partition}: offset {target} is past its end {next}; \
                             nothing was reset"
                        ),
                    ));
                }
                let committed = target.max(first);
                offsets.push((partition, committed));
                resets.push(PartitionReset {
                    partition,
                    committed_offset: committed,
                    first_offset: first,
                    before_retention: target < first,
                });
            }
            let (fenced, logged) = lock(&group).reset(store, &offsets, (force, log_here))?;
            let answer = ResetGroupOffsetsResponse {
                partitions: resets,
                members_fenced: u32::try_from(fenced).unwrap_or(u32::MAX),
            };
            Ok((answer, logged))
        })
        .await?;
    match (logged, &lead) {
        (Logged::Here(ticket), _) => context.calls.durable(Some(ticket)).await?,
        (Logged::Shard(queue, record), Some(lead)) => {
            if let Err(error) = lead.write_commit(queue, record).await {
                // The group in memory may be ahead of the log: it is loaded again.
                lock(&handle).retire();
                return Err(error);
            }
        }
        (Logged::Shard(..), None) => {
            return Err(WireError::new(
                ErrorCode::Internal,
                "a reset for the shard on a node that does not coordinate the group",
            ));
        }
    }
    Ok(answer)
}
