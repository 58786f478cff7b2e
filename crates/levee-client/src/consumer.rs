//! [`GroupConsumer`]: a member of a consumer group. It joins the group on one `Consume` stream,
//! runs a handler on each delivered message with bounded parallelism (one message at a time per
//! partition when `ordered`, any order otherwise), and commits each partition's offsets
//! strictly in order: a partition's commit never passes a message whose handler has not
//! finished, so a later message finishing first never skips an earlier one. Credit is granted
//! back as handlers finish, so the server never sends more than `credit_messages` unfinished
//! messages (back-pressure end to end). When the stream breaks it rejoins with exponential
//! backoff; the group redelivers from the last commit (at-least-once).
//!
//! A handler returns an [`Outcome`] (or `()`, or a `Result<(), E>`: `Err` is a retry with
//! the error's text). A retry or a reject is sent to the server, which moves the message into
//! the group's retry path or dead letters durably before answering; only then does the
//! message count as finished for the commits. Retried messages come back on the partition's
//! retry queue ([`Message::retry`], [`Message::attempt`], [`Message::last_error`]).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use levee_proto::WireError;
use levee_proto::v1::consume_request::Kind;
use levee_proto::v1::{
    Assignment, Commit, CommitBatch, ConsumeRequest, ConsumeStart, Credit, ErrorCode, Heartbeat,
    MessageOutcome, OutcomeAction, OutcomeBatch, OutcomeResult,
};
use tokio::sync::{Semaphore, mpsc};

use crate::client::Client;
use crate::error::ClientError;

/// Requests queued for the server on one stream.
const REQUESTS_QUEUED_MAX: usize = 64;

/// How a [`GroupConsumer`] runs.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// This member's id (default: a fresh one per process). A second stream with the same id
    /// replaces the first.
    pub member: Option<String>,
    /// Handlers running at once (default 16).
    pub parallelism: usize,
    /// One message at a time per partition, in offset order (default true). With false,
    /// messages of one partition may be handled concurrently; commits stay in order either way.
    pub ordered: bool,
    /// Messages delivered but not finished, at most (default 1000, at most 100000).
    pub credit_messages: u32,
    /// How often finished offsets are committed (default 100 ms).
    pub commit_interval: Duration,
    /// The lease: the server drops this member if it hears nothing for this long (default
    /// 10 s). Heartbeats go out every third of it.
    pub lease: Duration,
    /// First wait before rejoining after the stream broke (default 100 ms, doubling).
    pub backoff_initial: Duration,
    /// Longest wait before rejoining (default 5 s).
    pub backoff_max: Duration,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            member: None,
            parallelism: 16,
            ordered: true,
            credit_messages: 1_000,
            commit_interval: Duration::from_millis(100),
            lease: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
        }
    }
}

/// One delivered message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its partition.
    pub partition: u32,
    /// Its offset in the partition (for a retried message, where it was first published).
    pub offset: u64,
    /// Its payload: a slice of the received frame (cheap to clone).
    pub payload: levee_proto::Bytes,
    /// Which delivery this is: 1 the first, 2 the first retry, and so on.
    pub attempt: u32,
    /// A retried message: delivered from the partition's retry queue.
    pub retry: bool,
    /// With `retry`: the error its last failed attempt reported.
    pub last_error: String,
    /// With `retry`: when it was due again, ms since the Unix epoch by the server's clock.
    pub due_ms: u64,
    /// Its offset in the queue it was delivered from (the partition, or its retry queue).
    delivered_offset: u64,
}

/// What a handler decided for a message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Outcome {
    /// Done: counts as finished.
    #[default]
    Success,
    /// Failed: deliver it again later, after `delay` (or, with `None`, the group's retry
    /// policy's step); dead-lettered instead when the policy's attempts are spent.
    Retry {
        /// Wait this long instead of the policy's step (at most 7 days: longer is cut).
        delay: Option<Duration>,
        /// Why it failed, kept in the message's history (cut to 512 bytes).
        error: String,
    },
    /// Failed for good: straight to the group's dead letters.
    Reject {
        /// Why, kept in the message's history.
        error: String,
    },
}

impl Outcome {
    /// A retry after the group's policy's delay, with `error` as the reason.
    pub fn retry(error: impl std::fmt::Display) -> Self {
        Self::Retry {
            delay: None,
            error: error.to_string(),
        }
    }

    /// A retry after `delay`, with `error` as the reason.
    pub fn retry_after(delay: Duration, error: impl std::fmt::Display) -> Self {
        Self::Retry {
            delay: Some(delay),
            error: error.to_string(),
        }
    }

    /// A reject, with `error` as the reason.
    pub fn reject(error: impl std::fmt::Display) -> Self {
        Self::Reject {
            error: error.to_string(),
        }
    }
}

impl From<()> for Outcome {
    fn from((): ()) -> Self {
        Self::Success
    }
}

impl<E: std::fmt::Display> From<Result<(), E>> for Outcome {
    fn from(result: Result<(), E>) -> Self {
        match result {
            Ok(()) => Self::Success,
            Err(error) => Self::retry(error),
        }
    }
}

/// What a consumer did, returned when it stops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages whose handler finished.
    pub handled: u64,
    /// Commits the server confirmed durable.
    pub commits: u64,
    /// Commits the server refused because the partition had moved (fenced).
    pub fenced_commits: u64,
    /// Assignments received (the first one of each stream included).
    pub assignments: u64,
    /// Streams opened (1 + reconnections).
    pub streams: u64,
    /// Messages the server accepted for a retry.
    pub retried: u64,
    /// Messages the server moved to the dead letters (rejected, or attempts spent).
    pub dead_lettered: u64,
    /// Outcomes the server refused (the message is delivered again instead).
    pub outcomes_refused: u64,
}

/// A consumer-group member; see the module docs.
#[derive(Debug, Clone)]
pub struct GroupConsumer {
    client: Client,
    topic: String,
    group: String,
    member: String,
    options: ConsumerOptions,
    /// With [`GroupConsumer::following`]: the cluster's members it rejoins through when its
    /// node is unreachable.
    members: Option<Arc<tokio::sync::Mutex<crate::following::Members>>>,
}

/// How long a following group consumer waits for its node to answer before it rejoins
/// through another member.
const NODE_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// A partition (`false`) or its retry queue (`true`).
type Lane = (u32, bool);

/// Per lane: its epoch, undelivered-to-handler messages and commit frontier.
#[derive(Debug)]
struct PartitionState {
    epoch: u64,
    waiting: VecDeque<Message>,
    running: usize,
    /// Failed messages whose outcome the server has not answered yet.
    failing: usize,
    /// Every offset below this one is finished.
    frontier: u64,
    /// Finished offsets at or above the frontier.
    finished: BTreeSet<u64>,
    committed: u64,
}

impl PartitionState {
    /// Marks `offset` finished and moves the frontier past every finished offset.
    fn finish(&mut self, offset: u64) {
        self.finished.insert(offset);
        while self.finished.remove(&self.frontier) {
            self.frontier += 1;
        }
    }
}

/// Longest delay a retry may ask for (the server's bound): 7 days.
const DELAY_MS_MAX: u64 = 7 * 24 * 3_600_000;

/// Most outcomes in one outcome batch (the server's bound).
const OUTCOMES_PER_BATCH_MAX: usize = 1_024;

/// A job finished.
#[derive(Debug)]
struct Finished {
    lane: Lane,
    epoch: u64,
    /// The delivered offsets whose handler succeeded.
    done: Vec<u64>,
    /// Those whose handler failed, with what it decided.
    failed: Vec<(u64, Outcome)>,
    /// Messages handled and their payload bytes (the credit to grant back).
    messages: u32,
    bytes: u32,
}

/// Most messages of one partition handed to one task in ordered mode: they run one after the
/// other anyway, and one task per run of messages costs far less than one per message.
const ORDERED_JOB_MESSAGES_MAX: usize = 256;

fn fresh_member_id() -> String {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    let hash = foldhash::fast::RandomState::default().hash_one((nanos, std::process::id()));
    format!("member-{hash:016x}")
}

impl GroupConsumer {
    /// A member of `group` on `topic`, not yet joined ([`GroupConsumer::run`] joins).
    pub fn new(
        client: Client,
        topic: &str,
        group: &str,
        options: ConsumerOptions,
    ) -> Result<Self, ClientError> {
        if options.parallelism == 0
            || !(1..=100_000).contains(&options.credit_messages)
            || options.commit_interval.is_zero()
            || options.lease < Duration::from_secs(1)
        {
            return Err(ClientError::InvalidOptions(
                "parallelism must be at least 1, credit_messages 1 to 100000, commit_interval \
                 above 0 and lease at least 1 s"
                    .to_owned(),
            ));
        }
        let member = options.member.clone().unwrap_or_else(fresh_member_id);
        Ok(Self {
            client,
            topic: topic.to_owned(),
            group: group.to_owned(),
            member,
            options,
            members: None,
        })
    }

    /// This member, following the cluster (whose members it learns now): when its stream
    /// breaks and its node does not answer within a second, it rejoins through the next
    /// member. In a cluster that replicates its queues any node takes the stream to the
    /// group's coordinator (the leader of the topic's shard) and the group's commits are
    /// replicated (docs/CLUSTER.md, "Consumer groups on the shards"): the member resumes after
    /// its last answered commit (messages handled since may come again).
    pub async fn following(mut self) -> Self {
        let members = crate::following::Members::learned_from(self.client.clone()).await;
        self.members = Some(Arc::new(tokio::sync::Mutex::new(members)));
        self
    }

    /// This member's id.
    pub fn member(&self) -> &str {
        &self.member
    }

    /// Runs `handler` on every message until `stop` completes, rejoining after broken streams.
    /// On stop it waits for running handlers, commits what finished and leaves the group.
    /// Errors that retrying cannot fix (an unknown topic, invalid options) end it.
    pub async fn run<H, F, O>(
        &self,
        handler: H,
        stop: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, ClientError>
    where
        H: Fn(Message) -> F + Send + Sync + 'static,
        F: Future<Output = O> + Send + 'static,
        O: Into<Outcome> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let mut stats = ConsumerStats::default();
        let mut backoff = self.options.backoff_initial;
        let mut stop = std::pin::pin!(stop);
        let mut client = self.client.clone();
        loop {
            stats.streams += 1;
            let handled_before = stats.handled;
            let mut stopped = false;
            let result = self
                .stream(&client, &handler, (stop.as_mut(), &mut stopped), &mut stats)
                .await;
            if stopped {
                // `stop` completed (it must not be polled again): the stream ended while
                // stopping, whether or not its last commit got through.
                return result.map(|()| stats);
            }
            match result {
                Ok(()) => return Ok(stats),
                Err(error) if is_permanent(&error) => return Err(error),
                Err(error) => {
                    tracing::debug!(%error, member = %self.member, "consume stream broke; rejoining");
                    if let Some(members) = &self.members
                        && !matches!(
                            tokio::time::timeout(NODE_PROBE_TIMEOUT, client.server_info()).await,
                            Ok(Ok(_))
                        )
                    {
                        client = members.lock().await.next_member(NODE_PROBE_TIMEOUT).await;
                    }
                }
            }
            if stats.handled > handled_before {
                backoff = self.options.backoff_initial;
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = stop.as_mut() => return Ok(stats),
            }
            backoff = (backoff * 2).min(self.options.backoff_max);
        }
    }

    /// One stream, until it breaks (`Err`) or `stop` completes (`Ok`).
    async fn stream<H, F, O>(
        &self,
        client: &Client,
        handler: &Arc<H>,
        (mut stop, stopped): (std::pin::Pin<&mut impl Future<Output = ()>>, &mut bool),
        stats: &mut ConsumerStats,
    ) -> Result<(), ClientError>
    where
        H: Fn(Message) -> F + Send + Sync + 'static,
        F: Future<Output = O> + Send + 'static,
        O: Into<Outcome> + Send + 'static,
    {
        let (requests, receiver) = mpsc::channel(REQUESTS_QUEUED_MAX);
        let start = ConsumeRequest {
            kind: Some(Kind::Start(ConsumeStart {
                topic: self.topic.clone(),
                group: self.group.clone(),
                member: self.member.clone(),
                credit: Some(Credit {
                    messages: self.options.credit_messages,
                    bytes: 0,
                }),
                lease_ms: u32::try_from(self.options.lease.as_millis()).unwrap_or(u32::MAX),
            })),
        };
        let _ = requests.try_send(start);
        let mut responses = client
            .raw_topics_client()
            .consume(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        let closed = || WireError::new(ErrorCode::Unavailable, "the consume stream closed");
        let slots = Arc::new(Semaphore::new(self.options.parallelism));
        let in_flight_max = self.options.credit_messages as usize + self.options.parallelism;
        let (finished_sender, mut finished) = mpsc::channel::<Finished>(in_flight_max);
        let mut partitions: HashMap<Lane, PartitionState> = HashMap::new();
        let mut commit_tick = tokio::time::interval(self.options.commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heartbeat = tokio::time::interval(self.options.lease / 3);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stopping = false;
        // Commit batches sent and not yet answered (each gets one answer).
        let mut commits_awaiting = 0_usize;
        let mut outbox = Outbox::new(self.options.credit_messages);
        // Failed messages' outcomes waiting for the next commit tick.
        let mut failed = Vec::new();
        loop {
            outbox.try_flush(&requests).map_err(|()| closed())?;
            self.dispatch(&mut partitions, &slots, handler, &finished_sender);
            // Also waits for the answers to failed messages' outcomes, so their commits pass
            // them.
            if stopping
                && partitions
                    .values()
                    .all(|state| state.running == 0 && state.failing == 0)
            {
                final_commit(
                    &mut partitions,
                    (requests, outbox),
                    &mut responses,
                    commits_awaiting,
                    stats,
                )
                .await;
                return Ok(());
            }
            tokio::select! {
                response = responses.message() => {
                    let response = response?.ok_or_else(closed)?;
                    let taken = take_response(response, &mut partitions, stats)?;
                    if taken.commit_answered {
                        commits_awaiting = commits_awaiting.saturating_sub(1);
                    }
                    if taken.revoked_messages > 0 {
                        // Delivered for, or waiting in, partitions revoked meanwhile: hand
                        // the credit back.
                        outbox.credit(taken.revoked_messages, taken.revoked_bytes);
                    }
                }
                // Requests go out from the outbox while responses are read, so a server
                // waiting for this client to read never waits on a client waiting to send.
                permit = requests.reserve(), if !outbox.is_empty() => {
                    let permit = permit.map_err(|_| closed())?;
                    if let Some(request) = outbox.pop() {
                        permit.send(request);
                    }
                }
                Some(first) = finished.recv() => {
                    let mut done = vec![first];
                    while let Ok(more) = finished.try_recv() {
                        done.push(more);
                    }
                    stats.handled += done.iter().map(|job| u64::from(job.messages)).sum::<u64>();
                    outbox.finished(apply_finished(&mut partitions, done), &mut failed);
                }
                _ = commit_tick.tick() => {
                    outbox.outcomes(&mut failed);
                    let batch = commits_due(&mut partitions);
                    if !batch.is_empty() {
                        outbox.push(commit_request(batch));
                        commits_awaiting += 1;
                    }
                }
                _ = heartbeat.tick() => {
                    // Any request renews the lease: a heartbeat only when none waits.
                    if outbox.is_empty() {
                        outbox.push(ConsumeRequest { kind: Some(Kind::Heartbeat(Heartbeat {})) });
                    }
                }
                () = stop.as_mut(), if !stopping => {
                    stopping = true;
                    *stopped = true;
                    for state in partitions.values_mut() {
                        state.waiting.clear();
                    }
                }
            }
        }
    }

    /// Starts handlers for waiting messages while slots are free.
    fn dispatch<H, F, O>(
        &self,
        partitions: &mut HashMap<Lane, PartitionState>,
        slots: &Arc<Semaphore>,
        handler: &Arc<H>,
        finished: &mpsc::Sender<Finished>,
    ) where
        H: Fn(Message) -> F + Send + Sync + 'static,
        F: Future<Output = O> + Send + 'static,
        O: Into<Outcome> + Send + 'static,
    {
        for (&lane, state) in partitions.iter_mut() {
            while !state.waiting.is_empty() && (!self.options.ordered || state.running == 0) {
                let Ok(permit) = Arc::clone(slots).try_acquire_owned() else {
                    return;
                };
                let take = if self.options.ordered {
                    state.waiting.len().min(ORDERED_JOB_MESSAGES_MAX)
                } else {
                    1
                };
                let job: Vec<Message> = state.waiting.drain(..take).collect();
                state.running += 1;
                let (handler, finished) = (Arc::clone(handler), finished.clone());
                let epoch = state.epoch;
                tokio::spawn(async move {
                    let mut report = Finished {
                        lane,
                        epoch,
                        done: Vec::with_capacity(job.len()),
                        failed: Vec::new(),
                        messages: u32::try_from(job.len()).unwrap_or(u32::MAX),
                        bytes: 0,
                    };
                    for message in job {
                        let offset = message.delivered_offset;
                        let size = u32::try_from(message.payload.len()).unwrap_or(u32::MAX);
                        report.bytes = report.bytes.saturating_add(size);
                        match handler(message).await.into() {
                            Outcome::Success => report.done.push(offset),
                            failed => report.failed.push((offset, failed)),
                        }
                    }
                    drop(permit);
                    let _ = finished.send(report).await;
                });
            }
        }
    }
}

/// What one response from the server changed.
struct Taken {
    /// Messages (and their bytes) delivered for partitions no longer owned, or waiting in
    /// partitions revoked by a new assignment: not handled, their credit to give back.
    revoked_messages: u32,
    revoked_bytes: u32,
    /// The response answered a commit batch.
    commit_answered: bool,
}

/// Applies a response: a new assignment, deliveries queued per lane, commit and outcome
/// answers (an outcome refused for another reason than fencing breaks the stream, so the
/// message is delivered again).
fn take_response(
    response: levee_proto::v1::ConsumeResponse,
    partitions: &mut HashMap<Lane, PartitionState>,
    stats: &mut ConsumerStats,
) -> Result<Taken, ClientError> {
    let (revoked_messages, revoked_bytes) = match response.assignment {
        Some(assignment) => {
            stats.assignments += 1;
            apply_assignment(partitions, &assignment)
        }
        None => (0, 0),
    };
    let mut taken = Taken {
        revoked_messages,
        revoked_bytes,
        commit_answered: !response.commit_results.is_empty(),
    };
    for delivery in response.deliveries {
        if let Some(state) = partitions.get_mut(&(delivery.partition, delivery.retry))
            && state.epoch == delivery.epoch
        {
            let idle = state.waiting.is_empty()
                && state.running == 0
                && state.finished.is_empty()
                && state.failing == 0;
            if idle && delivery.offset > state.frontier {
                // Retention removed the messages in between: nothing to wait for.
                state.frontier = delivery.offset;
            }
            state.waiting.push_back(Message {
                partition: delivery.partition,
                offset: if delivery.retry {
                    delivery.original_offset
                } else {
                    delivery.offset
                },
                payload: delivery.payload,
                attempt: if delivery.retry { delivery.attempt } else { 1 },
                retry: delivery.retry,
                last_error: delivery.last_error,
                due_ms: delivery.due_ms,
                delivered_offset: delivery.offset,
            });
        } else {
            taken.revoked_messages += 1;
            let bytes = u32::try_from(delivery.payload.len()).unwrap_or(u32::MAX);
            taken.revoked_bytes = taken.revoked_bytes.saturating_add(bytes);
        }
    }
    count_commits(&response.commit_results, stats);
    take_outcome_results(&response.outcome_results, partitions, stats)?;
    Ok(taken)
}

/// Marks the messages whose outcome the server accepted finished.
fn take_outcome_results(
    results: &[OutcomeResult],
    partitions: &mut HashMap<Lane, PartitionState>,
    stats: &mut ConsumerStats,
) -> Result<(), ClientError> {
    for result in results {
        let lane = (result.partition, result.retry);
        if result.code == 0 {
            if result.dead_lettered {
                stats.dead_lettered += 1;
            } else {
                stats.retried += 1;
            }
            if let Some(state) = partitions.get_mut(&lane) {
                state.failing = state.failing.saturating_sub(1);
                state.finish(result.offset);
            }
        } else if result.code == ErrorCode::Fenced as i32 {
            // The partition moved: its new owner gets the message again.
            stats.outcomes_refused += 1;
        } else {
            stats.outcomes_refused += 1;
            // Not permanent for the consumer: it rejoins and gets the message again.
            return Err(ClientError::Server(WireError::new(
                ErrorCode::Unavailable,
                format!(
                    "the outcome of partition {} offset {} was refused (code {}): {}; \
                     rejoining",
                    result.partition, result.offset, result.code, result.message
                ),
            )));
        }
    }
    Ok(())
}

/// Marks finished handlers' successful offsets done (those of the current epochs) and moves
/// the commit frontiers; returns the credit to grant back (every handled message counts) and
/// the outcomes of the failed ones to send (they finish once the server accepts them).
fn apply_finished(
    partitions: &mut HashMap<Lane, PartitionState>,
    finished: Vec<Finished>,
) -> (u32, u32, Vec<MessageOutcome>) {
    let (mut messages, mut total_bytes) = (0_u32, 0_u32);
    let mut outcomes = Vec::new();
    for job in finished {
        messages = messages.saturating_add(job.messages);
        total_bytes = total_bytes.saturating_add(job.bytes);
        if let Some(state) = partitions.get_mut(&job.lane)
            && state.epoch == job.epoch
        {
            state.running -= 1;
            for offset in job.done {
                state.finish(offset);
            }
            state.failing += job.failed.len();
            outcomes.extend(
                job.failed
                    .into_iter()
                    .map(|(offset, outcome)| outcome_message(job.lane, job.epoch, offset, outcome)),
            );
        }
    }
    (messages, total_bytes, outcomes)
}

/// The wire form of a handler's failed outcome.
fn outcome_message(lane: Lane, epoch: u64, offset: u64, outcome: Outcome) -> MessageOutcome {
    let (action, delay, error) = match outcome {
        Outcome::Retry { delay, error } => (OutcomeAction::Retry, delay, error),
        Outcome::Reject { error } => (OutcomeAction::Reject, None, error),
        Outcome::Success => (OutcomeAction::Unspecified, None, String::new()),
    };
    MessageOutcome {
        partition: lane.0,
        epoch,
        offset,
        retry: lane.1,
        action: action as i32,
        // A delay under 1 ms is rounded up (0 would mean the policy's), one over 7 days cut.
        delay_ms: delay.map_or(0, |delay| {
            u64::try_from(delay.as_millis())
                .unwrap_or(u64::MAX)
                .clamp(1, DELAY_MS_MAX)
        }),
        error,
    }
}

/// Requests waiting to go out on the stream, in order; consecutive credits are merged. Bounded
/// by the messages in flight (a finished job adds a credit and at most one outcome batch per
/// 1,024 failures) plus a commit per commit interval while the server does not read.
#[derive(Debug, Default)]
struct Outbox(VecDeque<ConsumeRequest>, CreditOwed);

/// Credit to give back, held until it is worth a message: a stream that gives back a few
/// messages at a time gets a few delivered at a time, and stays in small rounds.
#[derive(Debug, Default)]
struct CreditOwed {
    messages: u32,
    bytes: u32,
    /// Give back once this many messages are owed (a sixteenth of the window).
    threshold: u32,
}

/// Give back once this many payload bytes are owed (whatever the messages).
const CREDIT_BYTES_THRESHOLD: u32 = 256 << 10;

impl Outbox {
    /// An outbox for a stream whose window is `credit_messages`.
    fn new(credit_messages: u32) -> Self {
        Self(
            VecDeque::new(),
            CreditOwed {
                threshold: (credit_messages / 16).max(1),
                ..CreditOwed::default()
            },
        )
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn push(&mut self, request: ConsumeRequest) {
        self.0.push_back(request);
    }

    fn pop(&mut self) -> Option<ConsumeRequest> {
        self.0.pop_front()
    }

    /// Sends what the stream's channel takes now, without waiting; the rest stays queued.
    fn try_flush(&mut self, requests: &mpsc::Sender<ConsumeRequest>) -> Result<(), ()> {
        while let Some(request) = self.0.pop_front() {
            match requests.try_send(request) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(request)) => {
                    self.0.push_front(request);
                    return Ok(());
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return Err(()),
            }
        }
        Ok(())
    }

    /// Queues what finished jobs give back: their credit at once; their failed messages'
    /// outcomes wait in `failed` for the next commit tick (or until a batch is full), so a
    /// server answers a few large outcome batches, not one per job.
    fn finished(
        &mut self,
        (messages, bytes, outcomes): (u32, u32, Vec<MessageOutcome>),
        failed: &mut Vec<MessageOutcome>,
    ) {
        self.credit(messages, bytes);
        failed.extend(outcomes);
        if failed.len() >= OUTCOMES_PER_BATCH_MAX {
            self.outcomes(failed);
        }
    }

    /// Queues the waiting outcomes, in batches of at most [`OUTCOMES_PER_BATCH_MAX`].
    fn outcomes(&mut self, failed: &mut Vec<MessageOutcome>) {
        for batch in failed.chunks(OUTCOMES_PER_BATCH_MAX) {
            self.push(ConsumeRequest {
                kind: Some(Kind::Outcomes(OutcomeBatch {
                    outcomes: batch.to_vec(),
                })),
            });
        }
        failed.clear();
    }

    /// Owes credit back; queues it once a sixteenth of the window (or 256 KiB) is owed. The
    /// server never starves for it: with the whole window owed, it goes.
    fn credit(&mut self, messages: u32, bytes: u32) {
        let owed = &mut self.1;
        owed.messages = owed.messages.saturating_add(messages);
        owed.bytes = owed.bytes.saturating_add(bytes);
        if owed.messages < owed.threshold && owed.bytes < CREDIT_BYTES_THRESHOLD {
            return;
        }
        let (messages, bytes) = (owed.messages, owed.bytes);
        (owed.messages, owed.bytes) = (0, 0);
        if let Some(ConsumeRequest {
            kind: Some(Kind::Credit(credit)),
        }) = self.0.back_mut()
        {
            credit.messages = credit.messages.saturating_add(messages);
            credit.bytes = credit.bytes.saturating_add(bytes);
            return;
        }
        self.push(credit_request(messages, bytes));
    }
}

/// On stop: sends what the outbox holds, commits what finished and waits (at most 5 s in all)
/// for the answers to every commit batch still unanswered, so the last commit is durable
/// before the member leaves; then closes the stream and waits (within the same 5 s) for the
/// server to end it, which it does once the member has left: a `DescribeGroup` after `run`
/// returns no longer lists it.
async fn final_commit(
    partitions: &mut HashMap<Lane, PartitionState>,
    (requests, mut outbox): (mpsc::Sender<ConsumeRequest>, Outbox),
    responses: &mut tonic::Streaming<levee_proto::v1::ConsumeResponse>,
    mut awaiting: usize,
    stats: &mut ConsumerStats,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let batch = commits_due(partitions);
    if !batch.is_empty() {
        outbox.push(commit_request(batch));
        awaiting += 1;
    }
    while let Some(request) = outbox.pop() {
        let sent = tokio::time::timeout_at(deadline, requests.send(request)).await;
        if !matches!(sent, Ok(Ok(()))) {
            return;
        }
    }
    while awaiting > 0 {
        let Ok(Ok(Some(response))) = tokio::time::timeout_at(deadline, responses.message()).await
        else {
            return;
        };
        if !response.commit_results.is_empty() {
            awaiting -= 1;
            count_commits(&response.commit_results, stats);
        }
    }
    // The request stream's end is the leave; deliveries still on their way are not handled
    // (they were not committed, so the group delivers them again).
    drop(requests);
    while let Ok(Ok(Some(_))) = tokio::time::timeout_at(deadline, responses.message()).await {}
}

fn is_permanent(error: &ClientError) -> bool {
    matches!(
        error.code(),
        Some(ErrorCode::InvalidArgument | ErrorCode::NotFound)
    ) || matches!(error, ClientError::InvalidOptions(_))
}

fn credit_request(messages: u32, bytes: u32) -> ConsumeRequest {
    ConsumeRequest {
        kind: Some(Kind::Credit(Credit { messages, bytes })),
    }
}

fn commit_request(commits: Vec<Commit>) -> ConsumeRequest {
    ConsumeRequest {
        kind: Some(Kind::Commit(CommitBatch { commits })),
    }
}

fn count_commits(results: &[levee_proto::v1::CommitResult], stats: &mut ConsumerStats) {
    for result in results {
        if result.code == ErrorCode::Fenced as i32 {
            stats.fenced_commits += 1;
        } else if result.code == 0 {
            stats.commits += 1;
        } else {
            tracing::warn!(
                partition = result.partition,
                code = result.code,
                message = %result.message,
                "commit refused"
            );
        }
    }
}

/// Takes the latest assignment: kept partitions (same epoch) keep their state, revoked ones
/// drop their waiting messages, new ones (and their retry queues) start at the group's
/// committed offsets. Returns the messages dropped and their payload bytes: the credit they
/// held, to grant back (the window is the stream's, not the partition's).
fn apply_assignment(
    partitions: &mut HashMap<Lane, PartitionState>,
    assignment: &Assignment,
) -> (u32, u32) {
    let mut next = HashMap::new();
    let mut dropped = Vec::new();
    for assigned in &assignment.partitions {
        for (retry, start) in [
            (false, assigned.start_offset),
            (true, assigned.retry_start_offset),
        ] {
            let lane = (assigned.partition, retry);
            let state = match partitions.remove(&lane) {
                Some(state) if state.epoch == assigned.epoch => state,
                replaced => {
                    dropped.extend(replaced);
                    PartitionState {
                        epoch: assigned.epoch,
                        waiting: VecDeque::new(),
                        running: 0,
                        failing: 0,
                        frontier: start,
                        finished: BTreeSet::new(),
                        committed: start,
                    }
                }
            };
            next.insert(lane, state);
        }
    }
    // What is left was revoked.
    dropped.extend(std::mem::replace(partitions, next).into_values());
    dropped.into_iter().flat_map(|state| state.waiting).fold(
        (0_u32, 0_u32),
        |(messages, bytes), message| {
            let size = u32::try_from(message.payload.len()).unwrap_or(u32::MAX);
            (messages.saturating_add(1), bytes.saturating_add(size))
        },
    )
}

/// The commits whose frontier moved since the last commit.
fn commits_due(partitions: &mut HashMap<Lane, PartitionState>) -> Vec<Commit> {
    partitions
        .iter_mut()
        .filter(|(_, state)| state.frontier > state.committed)
        .map(|(&(partition, retry), state)| {
            state.committed = state.frontier;
            Commit {
                partition,
                epoch: state.epoch,
                next_offset: state.frontier,
                retry,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_proto::v1::PartitionAssignment;

    #[test]
    fn given_a_failed_message_then_the_frontier_waits_for_its_outcome_to_be_accepted() {
        let mut partitions = HashMap::new();
        apply_assignment(&mut partitions, &assignment(&[(0, 1, 0)]));
        partitions.get_mut(&(0, false)).unwrap().running = 1;
        let job = Finished {
            lane: (0, false),
            epoch: 1,
            done: vec![1],
            failed: vec![(0, Outcome::retry_after(Duration::from_micros(10), "down"))],
            messages: 2,
            bytes: 6,
        };
        let (messages, bytes, outcomes) = apply_finished(&mut partitions, vec![job]);
        assert_eq!(
            (messages, bytes),
            (2, 6),
            "every handled message gives credit back"
        );
        assert_eq!(outcomes.len(), 1);
        assert_eq!(
            outcomes[0].delay_ms, 1,
            "rounded up, never 0 (the policy's)"
        );
        assert_eq!(outcomes[0].action, OutcomeAction::Retry as i32);
        assert!(
            commits_due(&mut partitions).is_empty(),
            "0 is not finished yet"
        );
        let mut stats = ConsumerStats::default();
        let accepted = OutcomeResult {
            partition: 0,
            offset: 0,
            ..OutcomeResult::default()
        };
        take_outcome_results(&[accepted], &mut partitions, &mut stats).unwrap();
        assert_eq!(stats.retried, 1);
        let due = commits_due(&mut partitions);
        assert_eq!(
            due[0].next_offset, 2,
            "accepted: finished, the commit passes both"
        );
        let refused = OutcomeResult {
            code: ErrorCode::NotFound as i32,
            ..OutcomeResult::default()
        };
        assert!(take_outcome_results(&[refused], &mut partitions, &mut stats).is_err());
        assert_eq!(Outcome::from(Err::<(), _>("bad")), Outcome::retry("bad"));
        assert_eq!(Outcome::from(()), Outcome::Success);
    }

    fn assignment(partitions: &[(u32, u64, u64)]) -> Assignment {
        Assignment {
            generation: 1,
            partitions: partitions
                .iter()
                .map(|&(partition, epoch, start_offset)| PartitionAssignment {
                    partition,
                    epoch,
                    start_offset,
                    retry_start_offset: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn given_out_of_order_finishes_then_commit_waits_for_the_earliest() {
        let mut partitions = HashMap::new();
        apply_assignment(&mut partitions, &assignment(&[(0, 1, 10)]));
        let state = partitions.get_mut(&(0, false)).unwrap();
        for offset in [11, 12] {
            state.finish(offset);
        }
        assert!(
            commits_due(&mut partitions).is_empty(),
            "10 is not finished"
        );
        partitions.get_mut(&(0, false)).unwrap().finish(10);
        let due = commits_due(&mut partitions);
        assert_eq!(due.len(), 1);
        assert_eq!(
            (due[0].epoch, due[0].next_offset, due[0].retry),
            (1, 13, false)
        );
        assert!(commits_due(&mut partitions).is_empty(), "nothing new");
    }

    #[test]
    fn given_reassignment_then_kept_partitions_keep_state_and_moved_ones_restart() {
        let mut partitions = HashMap::new();
        apply_assignment(&mut partitions, &assignment(&[(0, 1, 0), (1, 1, 0)]));
        partitions.get_mut(&(0, false)).unwrap().frontier = 5;
        partitions.get_mut(&(1, false)).unwrap().frontier = 7;
        apply_assignment(
            &mut partitions,
            &assignment(&[(0, 1, 0), (1, 2, 3), (2, 1, 9)]),
        );
        assert_eq!(partitions[&(0, false)].frontier, 5, "same epoch: kept");
        assert_eq!(
            partitions[&(1, false)].frontier,
            3,
            "new epoch: from the committed offset"
        );
        assert_eq!(partitions[&(2, false)].frontier, 9);
        apply_assignment(&mut partitions, &assignment(&[(2, 1, 9)]));
        assert_eq!(
            partitions.len(),
            2,
            "revoked partitions are dropped; a partition and its retry queue stay"
        );
    }

    #[test]
    fn given_waiting_messages_in_revoked_or_refenced_partitions_then_their_credit_is_returned() {
        let mut partitions = HashMap::new();
        apply_assignment(
            &mut partitions,
            &assignment(&[(0, 1, 0), (1, 1, 0), (2, 1, 0)]),
        );
        let message = |partition, offset, size: usize| Message {
            partition,
            offset,
            payload: levee_proto::Bytes::from(vec![0; size]),
            attempt: 1,
            retry: false,
            last_error: String::new(),
            due_ms: 0,
            delivered_offset: offset,
        };
        for (partition, size) in [(0, 10), (1, 20), (1, 30), (2, 5)] {
            let state = partitions.get_mut(&(partition, false)).unwrap();
            state.waiting.push_back(message(partition, 0, size));
        }
        // Partition 0 kept, 1 revoked, 2 under a new epoch.
        let returned = apply_assignment(&mut partitions, &assignment(&[(0, 1, 0), (2, 2, 0)]));
        assert_eq!(returned, (3, 55));
        assert_eq!(partitions[&(0, false)].waiting.len(), 1, "kept");
    }
}
