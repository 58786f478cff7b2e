//! One consumer-group member's `Consume` stream: joins the group, sends the member its
//! assignment whenever it changes, pushes messages of its partitions as they are published
//! (woken by the topic's [`Waiters`] entry, no polling) within the credit the client granted
//! and the group's rate, applies commits (fenced by epoch, durable before answered), and keeps
//! the member's lease while the client talks. The member leaves when the stream ends, and is
//! dropped when its lease runs out.

use std::collections::HashMap;
use std::pin::pin;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use levee_proto::WireError;
use levee_proto::v1::consume_request::Kind;
use levee_proto::v1::{
    Assignment, CommitResult, ConsumeRequest, ConsumeResponse, ConsumeStart, ErrorCode,
    TopicDelivery,
};
use tokio::sync::{Notify, watch};

use levee_broker::group::Commit;
use levee_broker::names::{check_group_on_topic, check_member_name, retry_queue};
use levee_broker::retry::RetryRecord;

use crate::metrics::{GroupLabels, Metrics};
use crate::queue::credit::{ROUND_BYTES_MAX, ROUND_MESSAGES_MAX, StreamCredit, check_credit};
use crate::queue::delay::Delayer;
use crate::queue::limits::group_rate::{Pacer, Pacers};
use crate::queue::limits::producer_rate::ProducerRates;
use crate::queue::replicated::Lead;
use crate::queue::stream::{Incoming, Outgoing};
use crate::queue::topic::catalog::{Topic, Topics};
use crate::queue::topic::group::{Groups, Logged, Membership};
use crate::queue::topic::retry::{self, OUTCOME_BATCHES_IN_FLIGHT_MAX, OUTCOMES_PER_BATCH_MAX};
use crate::queue::waiters::Waiters;
use crate::queue::{StoreCalls, invalid, name_error, storage_error};

/// Lease of a start that does not say.
pub const LEASE_MS_DEFAULT: u32 = 10_000;
/// Shortest lease a member may ask for.
pub const LEASE_MS_MIN: u32 = 1_000;
/// Longest lease a member may ask for.
pub const LEASE_MS_MAX: u32 = 300_000;
const _: () = assert!(
    LEASE_MS_MIN <= LEASE_MS_DEFAULT && LEASE_MS_DEFAULT <= LEASE_MS_MAX,
    "the default lease is within its bounds"
);
/// Most commits in one commit batch.
pub const COMMITS_PER_BATCH_MAX: usize = 1_024;

/// Milliseconds on the server's monotonic clock (leases).
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// The wake-up key of a topic in [`Waiters`]: publishing to the topic wakes its consumers.
pub fn topic_wake_key(topic: &str) -> Vec<u8> {
    topic_wake_key_bytes(topic.as_bytes())
}

/// [`topic_wake_key`] of a topic's name as bytes.
pub fn topic_wake_key_bytes(topic: &[u8]) -> Vec<u8> {
    let mut key = b"\0wake\0".to_vec();
    key.extend_from_slice(topic);
    key
}

/// What every consume stream shares.
#[derive(Debug)]
pub struct ConsumeContext {
    /// Store calls on the blocking pool.
    pub calls: StoreCalls,
    /// Topics.
    pub topics: Arc<Topics>,
    /// Groups.
    pub groups: Arc<Groups>,
    /// Group pacers.
    pub pacers: Arc<Pacers>,
    /// Producer rate limits (shared with the queue service).
    pub producer_rates: Arc<ProducerRates>,
    /// Topic wake-ups.
    pub waiters: Arc<Waiters>,
    /// Messages waiting for their time (retries, delayed publishes).
    pub delayer: Arc<Delayer>,
    /// Serialises writes to dead-letter queues with redrives of them.
    pub dead_letters: std::sync::Mutex<()>,
    /// The same, in a cluster that replicates its queues (the writes go through the shards).
    pub dead_letters_through_shards: tokio::sync::Mutex<()>,
    /// Whether the cluster replicates its queues: then a topic's groups are coordinated by
    /// the leader of its shard.
    pub replication: crate::queue::replicated::Replication,
    /// Metrics.
    pub metrics: Metrics,
    /// Turns true when the server shuts down.
    pub closing: watch::Receiver<bool>,
}

impl ConsumeContext {
    /// For a call served by this node only (the admin HTTP port): this node's lead of
    /// `topic`'s shard when the cluster replicates its queues (`None` when it does not);
    /// refused, naming the coordinator, when another node coordinates the topic's groups.
    pub fn lead_here(&self, topic: &str) -> Result<Option<Lead>, WireError> {
        match self.replication.coordinator(topic, false)? {
            crate::queue::replicated::Coordinator::Here(lead) => Ok(lead),
            crate::queue::replicated::Coordinator::Elsewhere { node, .. } => Err(WireError::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "node {node} coordinates topic '{topic}''s consumer groups; ask its admin \
                     port, or make the gRPC call (Topics) through any node"
                ),
            )),
        }
    }
}

/// Checks a start message; returns the lease.
pub fn check_start(start: &ConsumeStart) -> Result<Duration, WireError> {
    check_group_on_topic(&start.group, &start.topic).map_err(|error| name_error(&error))?;
    check_member_name(&start.member).map_err(|error| name_error(&error))?;
    check_credit(start.credit.as_ref())?;
    let lease_ms = match start.lease_ms {
        0 => LEASE_MS_DEFAULT,
        lease if (LEASE_MS_MIN..=LEASE_MS_MAX).contains(&lease) => lease,
        lease => {
            return Err(invalid(format!(
                "lease_ms must be {LEASE_MS_MIN} to {LEASE_MS_MAX} (or 0 for \
                 {LEASE_MS_DEFAULT}), got {lease}"
            )));
        }
    };
    Ok(Duration::from_millis(u64::from(lease_ms)))
}

/// Where delivery stands on one owned partition, or on its retry queue.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    partition: u32,
    epoch: u64,
    next: u64,
    retry: bool,
}

/// Turns a delivery of a retry queue's record into the retried message it carries (a record
/// that does not decode is delivered as it is, attempt 0, so the handler can reject it).
fn retried(delivery: &mut TopicDelivery) {
    delivery.retry = true;
    match RetryRecord::decode(&delivery.payload) {
        Some(record) => {
            delivery.attempt = record.attempts.saturating_add(1);
            record.last_error().clone_into(&mut delivery.last_error);
            delivery.original_offset = record.offset;
            delivery.due_ms = record.due_ms;
            delivery.payload = levee_proto::Bytes::from(record.payload);
        }
        None => delivery.attempt = 0,
    }
}

/// Returns once the server starts closing (the watch guard is dropped inside).
async fn wait_closed(closing: &mut watch::Receiver<bool>) {
    let _ = closing.wait_for(|closing| *closing).await;
}

/// The newest assignment, marked seen (the watch guard never lives across an await).
fn latest_assignment(changes: &mut watch::Receiver<Arc<Assignment>>) -> Arc<Assignment> {
    Arc::clone(&changes.borrow_and_update())
}

/// One member's stream.
#[derive(Debug)]
pub struct ConsumeSession {
    context: Arc<ConsumeContext>,
    topic: Arc<Topic>,
    group: String,
    membership: Membership,
    pacer: Arc<Pacer>,
    notify: Arc<Notify>,
    incoming: Incoming<ConsumeRequest>,
    outgoing: Outgoing<ConsumeResponse>,
    lease: Duration,
    cursors: Vec<Cursor>,
    /// The group's retry queue of each partition.
    retry_queues: Vec<Vec<u8>>,
    /// Outcome batches settling beside the stream.
    outcome_slots: Arc<tokio::sync::Semaphore>,
    /// The retry queues may hold something to deliver (else they are skipped until the
    /// delayer's retry generation moves past `retry_seen`).
    retry_pending: bool,
    retry_seen: u64,
    round_robin: usize,
    credit: StreamCredit,
    /// In a replicated cluster: this node's lead of the topic's shard, which coordinates the
    /// group (commits go through the shard; the stream ends when the lead is lost).
    lead: Option<Lead>,
}

/// What one delivery round did.
enum Delivered {
    Some,
    Nothing,
    Throttled(Duration),
    ClientGone,
}

impl ConsumeSession {
    /// Joins the group (reading its last commit from the store on first use, on the blocking
    /// pool) and returns the session. As the coordinator of a replicated cluster (`lead`),
    /// first waits out a new lead's hold and applies what the shard committed before.
    pub async fn join(
        context: Arc<ConsumeContext>,
        (start, lead): (ConsumeStart, Option<Lead>),
        incoming: Incoming<ConsumeRequest>,
        outgoing: Outgoing<ConsumeResponse>,
    ) -> Result<Self, WireError> {
        let lease = check_start(&start)?;
        let topic = context.topics.require_current(&start.topic).await?;
        if let Some(lead) = &lead {
            lead.settle().await?;
        }
        let term = lead.as_ref().map_or(0, |lead| lead.term);
        let groups = Arc::clone(&context.groups);
        let (group, member, joined_topic) = (
            start.group.clone(),
            start.member.clone(),
            Arc::clone(&topic),
        );
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        // Before the join, so nothing is left to undo if it failed (a topic's wake key is a
        // reserved name, never deleted, so it does not).
        let notify = context.waiters.register(&topic_wake_key(&topic.name))?;
        let membership = context
            .calls
            .run(move |store| {
                groups.join(
                    store,
                    (&group, &joined_topic, term),
                    &member,
                    (lease_ms, now_ms()),
                )
            })
            .await?;
        let labels = GroupLabels::new(&start.group);
        context.metrics.group_members.get_or_create(&labels).inc();
        context
            .metrics
            .group_rebalances
            .get_or_create(&labels)
            .inc();
        let pacer = context
            .pacers
            .get(&start.group, context.topics.rate(&start.group));
        let credit = StreamCredit::initial(start.credit);
        let retry_queues = (0..topic.partitions())
            .map(|partition| retry_queue(&start.group, &topic.name, partition))
            .collect();
        Ok(Self {
            retry_queues,
            outcome_slots: Arc::new(tokio::sync::Semaphore::new(OUTCOME_BATCHES_IN_FLIGHT_MAX)),
            retry_pending: true,
            retry_seen: 0,
            notify,
            context,
            topic,
            group: start.group,
            membership,
            pacer,
            incoming,
            outgoing,
            lease,
            cursors: Vec::new(),
            round_robin: 0,
            credit,
            lead,
        })
    }

    /// Serves the stream until the client leaves, its lease runs out or the server closes.
    pub async fn run(mut self) {
        let result = self.serve().await;
        self.membership.leave();
        let labels = GroupLabels::new(&self.group);
        self.context
            .metrics
            .group_members
            .get_or_create(&labels)
            .dec();
        self.context
            .metrics
            .group_rebalances
            .get_or_create(&labels)
            .inc();
        if let Err(error) = result {
            self.outgoing.fail(error).await;
        }
    }

    /// Takes the latest assignment: new partitions (and their retry queues) start at their
    /// committed offsets, kept ones (same epoch) keep their place, revoked ones are dropped.
    fn apply_assignment(&mut self, assignment: &Assignment) {
        let old: HashMap<(u32, bool), Cursor> = self
            .cursors
            .iter()
            .map(|cursor| ((cursor.partition, cursor.retry), *cursor))
            .collect();
        self.cursors = assignment
            .partitions
            .iter()
            .flat_map(|assigned| {
                [
                    (false, assigned.start_offset),
                    (true, assigned.retry_start_offset),
                ]
                .map(|(retry, start)| {
                    match old.get(&(assigned.partition, retry)) {
                        Some(cursor) if cursor.epoch == assigned.epoch => *cursor,
                        _ => Cursor {
                            partition: assigned.partition,
                            epoch: assigned.epoch,
                            next: start,
                            retry,
                        },
                    }
                })
            })
            .collect();
        self.retry_pending = true;
    }

    /// Takes and sends a new assignment (`alive`: the group still holds this stream, else
    /// the stream ends with why); false if the client is gone.
    async fn reassigned(
        &mut self,
        alive: bool,
        changes: &mut watch::Receiver<Arc<Assignment>>,
    ) -> Result<bool, WireError> {
        if !alive {
            // The group dropped this stream: its lease ran out, or the member joined again
            // on another stream.
            let reason = if self.membership.replaced() {
                "joined again on another stream"
            } else {
                "was dropped from the group (its lease ran out, an operator reset the group's \
                 offsets with force, or its coordinator loaded it again)"
            };
            return Err(WireError::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "member '{}' {reason}; this stream ends, join again",
                    self.membership.member
                ),
            ));
        }
        let latest = latest_assignment(changes);
        self.apply_assignment(&latest);
        Ok(self
            .outgoing
            .send(ConsumeResponse {
                assignment: Some((*latest).clone()),
                ..ConsumeResponse::default()
            })
            .await)
    }

    async fn serve(&mut self) -> Result<(), WireError> {
        let mut assignment_changes = self.membership.assignment.clone();
        let first = latest_assignment(&mut assignment_changes);
        self.apply_assignment(&first);
        if !self
            .outgoing
            .send(ConsumeResponse {
                assignment: Some((*first).clone()),
                ..ConsumeResponse::default()
            })
            .await
        {
            return Ok(());
        }
        let mut lease_deadline = tokio::time::Instant::now() + self.lease;
        let mut closing = self.context.closing.clone();
        let lead = self.lead.clone();
        let lost_lead = async {
            match &lead {
                Some(lead) => lead.lost().await,
                None => std::future::pending().await,
            }
        };
        let mut lost_lead = pin!(lost_lead);
        loop {
            let notify = Arc::clone(&self.notify);
            let mut woken = pin!(notify.notified());
            // Registered before the read, so a publish between the read and the wait wakes.
            woken.as_mut().enable();
            let throttle = match self.deliver().await? {
                Delivered::Some => continue,
                Delivered::ClientGone => return Ok(()),
                Delivered::Nothing => None,
                Delivered::Throttled(wait) => Some(wait),
            };
            let throttled = async {
                match throttle {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut woken => {}
                () = throttled => {
                    if let Some(wait) = throttle {
                        self.pacer.record_throttled(wait);
                    }
                }
                changed = assignment_changes.changed() => {
                    if !self.reassigned(changed.is_ok(), &mut assignment_changes).await? {
                        return Ok(());
                    }
                }
                message = self.incoming.message() => {
                    // A transport error (a message over the size limit) ends the stream with it.
                    let Some(message) = message? else { return Ok(()) };
                    if !self.membership.renew(now_ms()) {
                        return Err(WireError::new(
                            ErrorCode::FailedPrecondition,
                            "this member's lease ran out; join again",
                        ));
                    }
                    lease_deadline = tokio::time::Instant::now() + self.lease;
                    if !self.handle(message).await? {
                        return Ok(());
                    }
                }
                () = tokio::time::sleep_until(lease_deadline) => {
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        format!(
                            "member '{}': nothing heard for {} ms, the lease ran out and its \
                             partitions moved; join again",
                            self.membership.member,
                            self.lease.as_millis()
                        ),
                    ));
                }
                error = &mut lost_lead => {
                    self.context
                        .metrics
                        .group_coordinator_lost
                        .get_or_create(&GroupLabels::new(&self.group))
                        .inc();
                    return Err(error);
                }
                () = wait_closed(&mut closing) => {
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        "server shutting down; join again, to this server once it is back or to \
                         another",
                    ));
                }
            }
        }
    }

    /// One delivery round: reads the owned partitions round-robin, within the credit and the
    /// group's rate (reads come from the store's index and the page cache, inline).
    async fn deliver(&mut self) -> Result<Delivered, WireError> {
        if self.cursors.is_empty() || !self.credit.is_open() {
            return Ok(Delivered::Nothing);
        }
        let wanted = u64::from(self.credit.messages.min(ROUND_MESSAGES_MAX));
        let granted = match self.pacer.take(wanted) {
            Ok(granted) => granted,
            Err(wait) => return Ok(Delivered::Throttled(wait)),
        };
        let start = self.round_robin % self.cursors.len();
        self.round_robin = self.round_robin.wrapping_add(1);
        let store = &self.context.calls.store;
        let mut left = usize::try_from(granted).unwrap_or(usize::MAX);
        let mut bytes_left = self.credit.bytes.min(ROUND_BYTES_MAX) as usize;
        let mut batches = Vec::new();
        // Retry queues are read only when retries may have come (most rounds skip them).
        let generation = self.context.delayer.retry_generation();
        let read_retries = self.retry_pending || generation != self.retry_seen;
        let (mut retries_read, mut retries_found) = (0, false);
        for step in 0..self.cursors.len() {
            if left == 0 || bytes_left == 0 {
                break;
            }
            let index = (start + step) % self.cursors.len();
            let cursor = self.cursors[index];
            let queue = if cursor.retry {
                if !read_retries {
                    continue;
                }
                retries_read += 1;
                &self.retry_queues[cursor.partition as usize]
            } else {
                &self.topic.queues[cursor.partition as usize]
            };
            let batch = store
                .read(queue, cursor.next, left, bytes_left)
                .map_err(|error| storage_error(&error))?;
            retries_found |= cursor.retry && !batch.is_empty();
            left -= batch.len();
            bytes_left = bytes_left.saturating_sub(batch.bytes());
            batches.push((index, batch));
        }
        if read_retries {
            // Every retry queue read and none had anything: skip them until more come.
            let all_read = retries_read == self.cursors.len() / 2;
            self.retry_pending = retries_found || !all_read;
            self.retry_seen = generation;
        }
        let mut deliveries = Vec::new();
        let mut bytes = 0_usize;
        for (index, batch) in batches {
            let cursor = &mut self.cursors[index];
            if batch.skipped_to_first_retained {
                cursor.next = batch.first_offset;
            }
            if !cursor.retry {
                bytes += batch.bytes();
            }
            if !batch.is_empty() {
                cursor.next = batch.next_offset();
            }
            let first_offset = batch.first_offset;
            for (payload, offset) in crate::queue::payloads(batch).zip(first_offset..) {
                let mut delivery = TopicDelivery {
                    partition: cursor.partition,
                    epoch: cursor.epoch,
                    offset,
                    payload,
                    ..TopicDelivery::default()
                };
                if cursor.retry {
                    // The credit is in payload bytes, as the client gives it back: a retry
                    // record's history is not charged.
                    retried(&mut delivery);
                    bytes += delivery.payload.len();
                }
                deliveries.push(delivery);
            }
        }
        let sent = deliveries.len() as u64;
        self.pacer.give_back(granted - sent.min(granted));
        if deliveries.is_empty() {
            return Ok(Delivered::Nothing);
        }
        self.credit
            .spend(usize::try_from(sent).unwrap_or(usize::MAX), bytes);
        self.pacer.record_delivered(sent);
        let response = ConsumeResponse {
            deliveries,
            ..ConsumeResponse::default()
        };
        if !self.outgoing.send(response).await {
            return Ok(Delivered::ClientGone);
        }
        Ok(Delivered::Some)
    }

    /// Makes a commit snapshot durable: here, or through the shard as its coordinator (a
    /// failed write retires the group: its in-memory state may be ahead of the log, so every
    /// member joins again and the group is loaded again from what the shard holds).
    async fn log(&self, logged: Option<Logged>) -> Result<(), WireError> {
        match (logged, &self.lead) {
            (None, _) => Ok(()),
            (Some(Logged::Here(ticket)), _) => self.context.calls.durable(Some(ticket)).await,
            (Some(Logged::Shard(queue, record)), Some(lead)) => {
                let written = lead.write_commit(queue, record).await;
                if written.is_err() {
                    self.membership.retire();
                }
                written
            }
            (Some(Logged::Shard(..)), None) => Err(WireError::new(
                ErrorCode::Internal,
                "a commit for the shard on a node that does not coordinate the group",
            )),
        }
    }

    /// Applies one client message; false if the client is gone.
    async fn handle(&mut self, message: ConsumeRequest) -> Result<bool, WireError> {
        match message.kind {
            Some(Kind::Credit(credit)) => {
                self.credit.grant(credit);
                Ok(true)
            }
            Some(Kind::Heartbeat(_)) => Ok(true),
            Some(Kind::Commit(batch)) => {
                if batch.commits.len() > COMMITS_PER_BATCH_MAX {
                    return Err(invalid(format!(
                        "a commit batch holds at most {COMMITS_PER_BATCH_MAX} commits, got {}",
                        batch.commits.len()
                    )));
                }
                let commits: Vec<Commit> = batch
                    .commits
                    .iter()
                    .map(|commit| Commit {
                        partition: commit.partition,
                        epoch: commit.epoch,
                        next_offset: commit.next_offset,
                        retry: commit.retry,
                    })
                    .collect();
                // Through the shard, one snapshot at a time per group (in the order taken).
                let turn = self.membership.turn();
                let _turn = match &self.lead {
                    Some(_) => Some(turn.lock().await),
                    None => None,
                };
                let answers = self.membership.commit(
                    &self.context.calls.store,
                    &commits,
                    self.lead.is_none(),
                )?;
                self.log(answers.logged).await?;
                let commit_results = commits
                    .iter()
                    .zip(answers.results)
                    .map(|(commit, result)| match result {
                        Ok(committed) => CommitResult {
                            partition: commit.partition,
                            next_offset: committed,
                            retry: commit.retry,
                            ..CommitResult::default()
                        },
                        Err(error) => CommitResult {
                            partition: commit.partition,
                            next_offset: commit.next_offset,
                            code: error.code as i32,
                            message: error.message,
                            retry: commit.retry,
                        },
                    })
                    .collect();
                Ok(self
                    .outgoing
                    .send(ConsumeResponse {
                        commit_results,
                        ..ConsumeResponse::default()
                    })
                    .await)
            }
            Some(Kind::Outcomes(batch)) => {
                if batch.outcomes.len() > OUTCOMES_PER_BATCH_MAX {
                    return Err(invalid(format!(
                        "an outcome batch holds at most {OUTCOMES_PER_BATCH_MAX} outcomes, got {}",
                        batch.outcomes.len()
                    )));
                }
                // Judged and buffered here; the wait for durability runs beside the stream.
                let Ok(slot) = Arc::clone(&self.outcome_slots).acquire_owned().await else {
                    return Ok(false);
                };
                let judged = retry::judge(&self.context, &self.membership, &batch.outcomes);
                let (context, outgoing) = (Arc::clone(&self.context), self.outgoing.clone());
                tokio::spawn(async move {
                    let outcome_results = judged.settle(&context).await;
                    outgoing
                        .send(ConsumeResponse {
                            outcome_results,
                            ..ConsumeResponse::default()
                        })
                        .await;
                    drop(slot);
                });
                Ok(true)
            }
            Some(Kind::Start(_)) | None => Err(invalid(
                "a consume stream takes one start message".to_owned(),
            )),
        }
    }
}
