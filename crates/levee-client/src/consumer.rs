//! [`GroupConsumer`]: a member of a consumer group. It joins the group on one `Consume` stream,
//! runs a handler on each delivered message with bounded parallelism (one message at a time per
//! partition when `ordered`, any order otherwise), and commits each partition's offsets
//! strictly in order: a partition's commit never passes a message whose handler has not
//! finished, so a later message finishing first never skips an earlier one. Credit is granted
//! back as handlers finish, so the server never sends more than `credit_messages` unfinished
//! messages (back-pressure end to end). When the stream breaks it rejoins with exponential
//! backoff; the group redelivers from the last commit (at-least-once).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use levee_proto::WireError;
use levee_proto::v1::consume_request::Kind;
use levee_proto::v1::{
    Assignment, Commit, CommitBatch, ConsumeRequest, ConsumeStart, Credit, ErrorCode, Heartbeat,
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
    /// Its offset in the partition.
    pub offset: u64,
    /// Its payload: a slice of the received frame (cheap to clone).
    pub payload: levee_proto::Bytes,
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
}

/// A consumer-group member; see the module docs.
#[derive(Debug, Clone)]
pub struct GroupConsumer {
    client: Client,
    topic: String,
    group: String,
    member: String,
    options: ConsumerOptions,
}

/// Per partition: its epoch, undelivered-to-handler messages and commit frontier.
#[derive(Debug)]
struct PartitionState {
    epoch: u64,
    waiting: VecDeque<Message>,
    running: usize,
    /// Every offset below this one is finished.
    frontier: u64,
    /// Finished offsets at or above the frontier.
    finished: BTreeSet<u64>,
    committed: u64,
}

/// A job finished: (partition, epoch, the offsets it handled, their payload bytes).
type Finished = (u32, u64, Vec<u64>, u32);

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
        })
    }

    /// This member's id.
    pub fn member(&self) -> &str {
        &self.member
    }

    /// Runs `handler` on every message until `stop` completes, rejoining after broken streams.
    /// On stop it waits for running handlers, commits what finished and leaves the group.
    /// Errors that retrying cannot fix (an unknown topic, invalid options) end it.
    pub async fn run<H, F>(
        &self,
        handler: H,
        stop: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, ClientError>
    where
        H: Fn(Message) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let mut stats = ConsumerStats::default();
        let mut backoff = self.options.backoff_initial;
        let mut stop = std::pin::pin!(stop);
        loop {
            stats.streams += 1;
            let handled_before = stats.handled;
            match self.stream(&handler, stop.as_mut(), &mut stats).await {
                Ok(()) => return Ok(stats),
                Err(error) if is_permanent(&error) => return Err(error),
                Err(error) => {
                    tracing::debug!(%error, member = %self.member, "consume stream broke; rejoining");
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
    async fn stream<H, F>(
        &self,
        handler: &Arc<H>,
        mut stop: std::pin::Pin<&mut impl Future<Output = ()>>,
        stats: &mut ConsumerStats,
    ) -> Result<(), ClientError>
    where
        H: Fn(Message) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
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
        let mut responses = self
            .client
            .raw_topics_client()
            .consume(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        let closed = || WireError::new(ErrorCode::Unavailable, "the consume stream closed");
        let slots = Arc::new(Semaphore::new(self.options.parallelism));
        let in_flight_max = self.options.credit_messages as usize + self.options.parallelism;
        let (finished_sender, mut finished) = mpsc::channel::<Finished>(in_flight_max);
        let mut partitions: HashMap<u32, PartitionState> = HashMap::new();
        let mut commit_tick = tokio::time::interval(self.options.commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heartbeat = tokio::time::interval(self.options.lease / 3);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stopping = false;
        // Commit batches sent and not yet answered (each gets one answer).
        let mut commits_awaiting = 0_usize;
        loop {
            self.dispatch(&mut partitions, &slots, handler, &finished_sender);
            if stopping && partitions.values().all(|state| state.running == 0) {
                final_commit(
                    &mut partitions,
                    &requests,
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
                    let taken = take_response(response, &mut partitions, stats);
                    if taken.commit_answered {
                        commits_awaiting = commits_awaiting.saturating_sub(1);
                    }
                    if taken.revoked_messages > 0 {
                        // Delivered for partitions revoked meanwhile: hand the credit back.
                        let credit = credit_request(taken.revoked_messages, taken.revoked_bytes);
                        requests.send(credit).await.map_err(|_| closed())?;
                    }
                }
                Some(first) = finished.recv() => {
                    let mut done = vec![first];
                    while let Ok(more) = finished.try_recv() {
                        done.push(more);
                    }
                    stats.handled += done.iter().map(|job| job.2.len() as u64).sum::<u64>();
                    let (messages, bytes) = apply_finished(&mut partitions, &done);
                    requests
                        .send(credit_request(messages, bytes))
                        .await
                        .map_err(|_| closed())?;
                }
                _ = commit_tick.tick() => {
                    let batch = commits_due(&mut partitions);
                    if !batch.is_empty() {
                        requests.send(commit_request(batch)).await.map_err(|_| closed())?;
                        commits_awaiting += 1;
                    }
                }
                _ = heartbeat.tick() => {
                    let beat = ConsumeRequest { kind: Some(Kind::Heartbeat(Heartbeat {})) };
                    requests.send(beat).await.map_err(|_| closed())?;
                }
                () = stop.as_mut(), if !stopping => {
                    stopping = true;
                    for state in partitions.values_mut() {
                        state.waiting.clear();
                    }
                }
            }
        }
    }

    /// Starts handlers for waiting messages while slots are free.
    fn dispatch<H, F>(
        &self,
        partitions: &mut HashMap<u32, PartitionState>,
        slots: &Arc<Semaphore>,
        handler: &Arc<H>,
        finished: &mpsc::Sender<Finished>,
    ) where
        H: Fn(Message) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        for state in partitions.values_mut() {
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
                    let partition = job[0].partition;
                    let mut offsets = Vec::with_capacity(job.len());
                    let mut bytes = 0_u32;
                    for message in job {
                        offsets.push(message.offset);
                        let size = u32::try_from(message.payload.len()).unwrap_or(u32::MAX);
                        bytes = bytes.saturating_add(size);
                        handler(message).await;
                    }
                    drop(permit);
                    let _ = finished.send((partition, epoch, offsets, bytes)).await;
                });
            }
        }
    }
}

/// What one response from the server changed.
struct Taken {
    /// Messages (and their bytes) delivered for partitions no longer owned: not handled.
    revoked_messages: u32,
    revoked_bytes: u32,
    /// The response answered a commit batch.
    commit_answered: bool,
}

/// Applies a response: a new assignment, deliveries queued per partition, commit answers.
fn take_response(
    response: levee_proto::v1::ConsumeResponse,
    partitions: &mut HashMap<u32, PartitionState>,
    stats: &mut ConsumerStats,
) -> Taken {
    if let Some(assignment) = response.assignment {
        stats.assignments += 1;
        apply_assignment(partitions, &assignment);
    }
    let mut taken = Taken {
        revoked_messages: 0,
        revoked_bytes: 0,
        commit_answered: !response.commit_results.is_empty(),
    };
    for delivery in response.deliveries {
        if let Some(state) = partitions.get_mut(&delivery.partition)
            && state.epoch == delivery.epoch
        {
            let idle = state.waiting.is_empty() && state.running == 0 && state.finished.is_empty();
            if idle && delivery.offset > state.frontier {
                // Retention removed the messages in between: nothing to wait for.
                state.frontier = delivery.offset;
            }
            state.waiting.push_back(Message {
                partition: delivery.partition,
                offset: delivery.offset,
                payload: delivery.payload,
            });
        } else {
            taken.revoked_messages += 1;
            let bytes = u32::try_from(delivery.payload.len()).unwrap_or(u32::MAX);
            taken.revoked_bytes = taken.revoked_bytes.saturating_add(bytes);
        }
    }
    count_commits(&response.commit_results, stats);
    taken
}

/// Marks finished handlers' offsets done (those of the current epochs) and moves the commit
/// frontiers; returns the credit to grant back (every finished message counts).
fn apply_finished(partitions: &mut HashMap<u32, PartitionState>, done: &[Finished]) -> (u32, u32) {
    let (mut messages, mut total_bytes) = (0_u32, 0_u32);
    for (partition, epoch, offsets, bytes) in done {
        messages = messages.saturating_add(u32::try_from(offsets.len()).unwrap_or(u32::MAX));
        total_bytes = total_bytes.saturating_add(*bytes);
        if let Some(state) = partitions.get_mut(partition)
            && state.epoch == *epoch
        {
            state.running -= 1;
            state.finished.extend(offsets);
            while state.finished.remove(&state.frontier) {
                state.frontier += 1;
            }
        }
    }
    (messages, total_bytes)
}

/// On stop: commits what finished and waits (at most 5 s) for the answers to every commit
/// batch still unanswered, so the last commit is durable before the member leaves.
async fn final_commit(
    partitions: &mut HashMap<u32, PartitionState>,
    requests: &mpsc::Sender<ConsumeRequest>,
    responses: &mut tonic::Streaming<levee_proto::v1::ConsumeResponse>,
    mut awaiting: usize,
    stats: &mut ConsumerStats,
) {
    let batch = commits_due(partitions);
    if !batch.is_empty() && requests.send(commit_request(batch)).await.is_ok() {
        awaiting += 1;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
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
/// drop their waiting messages, new ones start at the group's committed offset.
fn apply_assignment(partitions: &mut HashMap<u32, PartitionState>, assignment: &Assignment) {
    let mut next = HashMap::new();
    for assigned in &assignment.partitions {
        let state = match partitions.remove(&assigned.partition) {
            Some(state) if state.epoch == assigned.epoch => state,
            _ => PartitionState {
                epoch: assigned.epoch,
                waiting: VecDeque::new(),
                running: 0,
                frontier: assigned.start_offset,
                finished: BTreeSet::new(),
                committed: assigned.start_offset,
            },
        };
        next.insert(assigned.partition, state);
    }
    *partitions = next;
}

/// The commits whose frontier moved since the last commit.
fn commits_due(partitions: &mut HashMap<u32, PartitionState>) -> Vec<Commit> {
    partitions
        .iter_mut()
        .filter(|(_, state)| state.frontier > state.committed)
        .map(|(&partition, state)| {
            state.committed = state.frontier;
            Commit {
                partition,
                epoch: state.epoch,
                next_offset: state.frontier,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_proto::v1::PartitionAssignment;

    fn assignment(partitions: &[(u32, u64, u64)]) -> Assignment {
        Assignment {
            generation: 1,
            partitions: partitions
                .iter()
                .map(|&(partition, epoch, start_offset)| PartitionAssignment {
                    partition,
                    epoch,
                    start_offset,
                })
                .collect(),
        }
    }

    #[test]
    fn given_out_of_order_finishes_then_commit_waits_for_the_earliest() {
        let mut partitions = HashMap::new();
        apply_assignment(&mut partitions, &assignment(&[(0, 1, 10)]));
        let state = partitions.get_mut(&0).unwrap();
        for offset in [11, 12] {
            state.finished.insert(offset);
        }
        while state.finished.remove(&state.frontier) {
            state.frontier += 1;
        }
        assert!(
            commits_due(&mut partitions).is_empty(),
            "10 is not finished"
        );
        let state = partitions.get_mut(&0).unwrap();
        state.finished.insert(10);
        while state.finished.remove(&state.frontier) {
            state.frontier += 1;
        }
        let due = commits_due(&mut partitions);
        assert_eq!(due.len(), 1);
        assert_eq!((due[0].epoch, due[0].next_offset), (1, 13));
        assert!(commits_due(&mut partitions).is_empty(), "nothing new");
    }

    #[test]
    fn given_reassignment_then_kept_partitions_keep_state_and_moved_ones_restart() {
        let mut partitions = HashMap::new();
        apply_assignment(&mut partitions, &assignment(&[(0, 1, 0), (1, 1, 0)]));
        partitions.get_mut(&0).unwrap().frontier = 5;
        partitions.get_mut(&1).unwrap().frontier = 7;
        apply_assignment(
            &mut partitions,
            &assignment(&[(0, 1, 0), (1, 2, 3), (2, 1, 9)]),
        );
        assert_eq!(partitions[&0].frontier, 5, "same epoch: kept");
        assert_eq!(
            partitions[&1].frontier, 3,
            "new epoch: from the committed offset"
        );
        assert_eq!(partitions[&2].frontier, 9);
        apply_assignment(&mut partitions, &assignment(&[(2, 1, 9)]));
        assert_eq!(partitions.len(), 1, "revoked partitions are dropped");
    }
}
