//! The consumer group of `levee bench failover --shape queue`: a topic placed in a shard that
//! the kills hit (the shard of queue `failover-0`), published to by an idempotent publisher
//! (one message at a time, resent through the next node until stored), and consumed by one
//! member of a group over a raw `Consume` stream through one node after another (the next one
//! whenever its stream ends), committing after every delivery and counting what its commits'
//! answers confirmed. The group's coordinator is the leader of the topic's shard
//! (docs/CLUSTER.md, "Consumer groups on the shards"), so about one kill in `--shards` kills
//! the coordinator. `commit_redelivered` counts deliveries below an answered commit (a
//! failover must never hand them out again); `not_delivered` the published messages never
//! delivered; `unknown_seen` deliveries that were never published at their place.
//! `group_failover_ms`: from a kill of the coordinator to the next answered commit.
//!
//! Every [`DELAYED_EVERY`]th message is also published delayed by [`DELAY`] (a plain publish,
//! resent through the next node until answered: delayed messages are not deduplicated), so
//! delayed messages wait in the shard's delay slots while its leaders are killed
//! (docs/CLUSTER.md, "Retries and delayed messages through the shards"). `delayed_lost`
//! counts the answered ones never delivered, `delayed_early` those delivered before the time
//! their publish answered (the processes share this machine's clock) or, for one resent,
//! before its first try's time (`delayed_by_an_earlier_try` counts those delivered between the
//! two: the copy a try whose answer was lost stored, due earlier), `delayed_twice` those
//! delivered more than once (a resend of a publish whose answer was lost stores it again, and
//! a coordinator's failover hands out again what was delivered but not yet committed).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use levee_client::Client;
use levee_proto::v1::consume_request::Kind;
use levee_proto::v1::topics_client::TopicsClient;
use levee_proto::v1::{
    Commit, CommitBatch, ConsumeRequest, ConsumeStart, Credit, ErrorCode, PublishMessage,
    PublishRequest,
};
use serde_json::{Value, json};
use tokio::sync::watch;

/// The topic's partitions.
const PARTITIONS: u32 = 4;
/// Credit the member keeps open (messages).
const CREDIT: u32 = 256;
/// Longest one publish is resent before the run gives up.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between two publishes.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(5);
/// Messages the run keeps a record of, at most (it stops publishing beyond).
const MESSAGES_MAX: usize = 1_000_000;
/// Longest the member may take, once publishing stopped, to be handed every message.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// One message in this many is also published delayed.
const DELAYED_EVERY: u64 = 10;
/// How long a delayed message waits.
const DELAY: Duration = Duration::from_millis(700);
/// The payload prefix of delayed messages.
const DELAYED_PREFIX: &[u8] = b"delayed-";

/// What the publisher and the member recorded.
#[derive(Debug, Default)]
pub(super) struct GroupRun {
    /// Each stored message's payload at its (partition, offset).
    published: BTreeMap<(u32, u64), Vec<u8>>,
    /// Publishes resent at least once.
    resent: u64,
    delivered: u64,
    /// Every (partition, offset, payload) delivered.
    seen: Vec<(u32, u64, Vec<u8>)>,
    /// Per partition: the committed offset the last answered commit confirmed.
    confirmed: BTreeMap<u32, u64>,
    commit_redelivered: u64,
    commits_answered: u64,
    /// When each commit answer came.
    commit_times: Vec<Instant>,
    /// Streams opened after the first.
    rejoined: u64,
    /// Each answered delayed message's payload: when its publish said it is due and when its
    /// first try was sent (ms since the Unix epoch), and whether it was resent.
    delayed: BTreeMap<Vec<u8>, DelayedPublish>,
    /// Each delayed message delivered: when it first was (ms since the Unix epoch), and how
    /// many times.
    delayed_seen: BTreeMap<Vec<u8>, (u64, u64)>,
}

/// One answered delayed publish (see [`GroupRun::delayed`]).
#[derive(Debug, Clone, Copy)]
struct DelayedPublish {
    due_ms: u64,
    first_sent_ms: u64,
    resent: bool,
}

/// The run's record, shared by its tasks.
pub(super) type Shared = Arc<Mutex<GroupRun>>;

fn lock(run: &Shared) -> std::sync::MutexGuard<'_, GroupRun> {
    run.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A topic placed in the shard of queue `failover-0` among `shards`.
fn topic(shards: u32) -> String {
    let shard = levee_proto::shards::shard_of("failover-0", shards);
    // One name in `shards` falls in each shard on average: a million tries always find one.
    (0_u64..1_000_000)
        .map(|n| format!("failover-topic-{n}"))
        .find(|topic| levee_proto::shards::shard_of(topic, shards) == shard)
        .unwrap_or_else(|| "failover-topic".to_owned())
}

/// The group's part of a run: its topic, record and tasks.
pub(super) struct Group {
    /// The topic.
    pub(super) topic: String,
    /// What its publisher and member recorded.
    pub(super) run: Shared,
    stop_publishing: watch::Sender<bool>,
    publishing: tokio::task::JoinHandle<anyhow::Result<()>>,
    member: tokio::task::JoinHandle<()>,
}

impl Group {
    /// Creates the topic (in the shard of queue `failover-0` among `shards`) through
    /// `clients[0]` and starts its publisher and member (`addresses`: every node's gRPC
    /// address); the member stops when `stop` turns true.
    pub(super) async fn start(
        clients: &[Client],
        addresses: Vec<String>,
        shards: u32,
        stop: watch::Receiver<bool>,
    ) -> anyhow::Result<Self> {
        let topic = topic(shards);
        clients[0].create_topic(&topic, PARTITIONS).await?;
        let run = Shared::default();
        let (stop_publishing, publishing_stopped) = watch::channel(false);
        let publishing = tokio::spawn(publish_continuously(
            clients.to_vec(),
            topic.clone(),
            Arc::clone(&run),
            publishing_stopped,
        ));
        let member = tokio::spawn(consume_continuously(
            addresses,
            topic.clone(),
            Arc::clone(&run),
            stop,
        ));
        Ok(Self {
            topic,
            run,
            stop_publishing,
            publishing,
            member,
        })
    }

    /// Stops publishing and waits until the member was handed every message (or
    /// [`DRAIN_TIMEOUT`] passed).
    pub(super) async fn drain(&mut self) -> anyhow::Result<()> {
        let _ = self.stop_publishing.send(true);
        (&mut self.publishing)
            .await
            .context("the publishing task")??;
        wait_drained(&self.run).await;
        Ok(())
    }

    /// Once the member was told to stop: waits for it, and reports (see [`report`]).
    pub(super) async fn finish(self, failovers: &Histogram<u64>) -> anyhow::Result<(Value, bool)> {
        self.member.await.context("the group member's task")?;
        Ok(report(&self.run, failovers))
    }
}

/// Publishes message after message to `topic` as one idempotent producer, each resent through
/// the next node until stored, until told to stop.
async fn publish_continuously(
    clients: Vec<Client>,
    topic: String,
    run: Shared,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut sequences = [0_u64; PARTITIONS as usize];
    let mut node = 0;
    for number in 0_u64.. {
        if *stop.borrow() || lock(&run).published.len() >= MESSAGES_MAX {
            return Ok(());
        }
        let key = number.to_string();
        let partition = levee_proto::topic_partition(key.as_bytes(), PARTITIONS);
        let sequence = &mut sequences[partition as usize];
        let request = PublishRequest {
            topic: topic.clone(),
            messages: vec![PublishMessage {
                key: key.clone().into_bytes().into(),
                payload: key.clone().into_bytes().into(),
                sequence: *sequence,
                ..PublishMessage::default()
            }],
            producer_id: "failover-publisher".to_owned(),
            ..PublishRequest::default()
        };
        *sequence += 1;
        let stored = through_next_nodes(&clients, &mut node, &run, |client| {
            let request = request.clone();
            async move { client.publish_request(request).await }
        })
        .await
        .context("publishing to the group's topic")?;
        let place = stored
            .first()
            .copied()
            .context("a publish answered nothing")?;
        lock(&run).published.insert(place, key.into_bytes());
        if number % DELAYED_EVERY == 0 {
            publish_delayed(&clients, (&topic, number), &run, &mut node).await?;
        }
        tokio::select! {
            () = tokio::time::sleep(PUBLISH_INTERVAL) => {}
            _ = stop.changed() => {}
        }
    }
    Ok(())
}

/// Publishes message `number` delayed by [`DELAY`], resent through the next node until
/// answered, and records when it is due.
async fn publish_delayed(
    clients: &[Client],
    (topic, number): (&str, u64),
    run: &Shared,
    node: &mut usize,
) -> anyhow::Result<()> {
    let mut payload = DELAYED_PREFIX.to_vec();
    payload.extend_from_slice(number.to_string().as_bytes());
    let first_sent_ms = super::unix_ms();
    let tries = std::sync::atomic::AtomicU32::new(0);
    let due = through_next_nodes(clients, node, run, |client| {
        let (topic, payload) = (topic.to_owned(), payload.clone());
        tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        async move {
            client
                .publish_delayed(&topic, &[(&payload, &payload)], DELAY)
                .await
        }
    })
    .await
    .context("publishing a delayed message")?;
    let due_ms = due.first().map_or(0, |(_, due_ms)| *due_ms);
    lock(run).delayed.insert(
        payload,
        DelayedPublish {
            due_ms,
            first_sent_ms,
            resent: tries.load(std::sync::atomic::Ordering::Relaxed) > 1,
        },
    );
    Ok(())
}

/// Calls `call` through node `node`, then through the next one after each failure (counted
/// as a resend), until it succeeds or [`PUBLISH_TIMEOUT`] passed.
async fn through_next_nodes<T, Call, Calling>(
    clients: &[Client],
    node: &mut usize,
    run: &Shared,
    call: Call,
) -> Result<T, levee_client::ClientError>
where
    Call: Fn(Client) -> Calling,
    Calling: std::future::Future<Output = Result<T, levee_client::ClientError>>,
{
    let started = Instant::now();
    loop {
        match call(clients[*node % clients.len()].clone()).await {
            Ok(answer) => return Ok(answer),
            Err(error) if started.elapsed() < PUBLISH_TIMEOUT => {
                tracing::debug!(%error, "a publish failed; resending through the next node");
                lock(run).resent += 1;
                *node += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// The group's one member: a stream through one node after another, committing after every
/// delivery, until told to stop.
async fn consume_continuously(
    addresses: Vec<String>,
    topic: String,
    run: Shared,
    stop: watch::Receiver<bool>,
) {
    for node in 0_usize.. {
        if *stop.borrow() {
            return;
        }
        if node > 0 {
            lock(&run).rejoined += 1;
        }
        let address = &addresses[node % addresses.len()];
        if let Err(error) = one_stream(address, &topic, &run, stop.clone()).await {
            tracing::debug!(%error, "the member's stream ended; joining through the next node");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One stream of the member through `address`, until it ends (`Err`) or `stop` (`Ok`).
async fn one_stream(
    address: &str,
    topic: &str,
    run: &Shared,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let (sender, receiver) = tokio::sync::mpsc::channel(64);
    let start = ConsumeStart {
        topic: topic.to_owned(),
        group: "failover-group".to_owned(),
        member: "failover-member".to_owned(),
        credit: Some(Credit {
            messages: CREDIT,
            bytes: 0,
        }),
        lease_ms: 0,
    };
    sender
        .send(ConsumeRequest {
            kind: Some(Kind::Start(start)),
        })
        .await?;
    let mut client = TopicsClient::connect(format!("http://{address}")).await?;
    let mut answers = client
        .consume(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    loop {
        let answer = tokio::select! {
            answer = answers.message() => answer?.context("the stream ended")?,
            _ = stop.changed() => return Ok(()),
        };
        let mut commits = BTreeMap::new();
        {
            let mut run = lock(run);
            for result in &answer.commit_results {
                if result.code == ErrorCode::Unspecified as i32 {
                    let confirmed = run.confirmed.entry(result.partition).or_default();
                    *confirmed = (*confirmed).max(result.next_offset);
                }
            }
            if !answer.commit_results.is_empty() {
                run.commits_answered += 1;
                run.commit_times.push(Instant::now());
            }
            for delivery in &answer.deliveries {
                run.delivered += 1;
                if delivery.offset < run.confirmed.get(&delivery.partition).copied().unwrap_or(0) {
                    run.commit_redelivered += 1;
                }
                if delivery.payload.starts_with(DELAYED_PREFIX) {
                    // Its place is not known before it is delivered: checked by its payload.
                    let seen = run
                        .delayed_seen
                        .entry(delivery.payload.to_vec())
                        .or_insert((super::unix_ms(), 0));
                    seen.1 += 1;
                } else if run.seen.len() < MESSAGES_MAX {
                    run.seen.push((
                        delivery.partition,
                        delivery.offset,
                        delivery.payload.to_vec(),
                    ));
                }
                commits.insert(delivery.partition, (delivery.epoch, delivery.offset + 1));
            }
        }
        if answer.deliveries.is_empty() {
            continue;
        }
        let bytes: usize = answer.deliveries.iter().map(|d| d.payload.len()).sum();
        let credit = Credit {
            messages: u32::try_from(answer.deliveries.len()).unwrap_or(u32::MAX),
            bytes: u32::try_from(bytes).unwrap_or(u32::MAX),
        };
        let commits = commits
            .into_iter()
            .map(|(partition, (epoch, next_offset))| Commit {
                partition,
                epoch,
                next_offset,
                retry: false,
            })
            .collect();
        for request in [Kind::Commit(CommitBatch { commits }), Kind::Credit(credit)] {
            sender
                .send(ConsumeRequest {
                    kind: Some(request),
                })
                .await?;
        }
    }
}

/// Waits for the first answered commit after `killed_at` (within [`DRAIN_TIMEOUT`]); the
/// time from `killed_at` to it.
pub(super) async fn wait_commit_after(
    run: &Shared,
    killed_at: Instant,
) -> anyhow::Result<Duration> {
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    loop {
        let answered = lock(run)
            .commit_times
            .iter()
            .find(|at| **at > killed_at)
            .map(|at| *at - killed_at);
        if let Some(answered) = answered {
            return Ok(answered);
        }
        if Instant::now() >= deadline {
            bail!("no commit of the group was answered within {DRAIN_TIMEOUT:?} of a kill");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Once publishing stopped: waits until every published message was delivered (within
/// [`DRAIN_TIMEOUT`]).
async fn wait_drained(run: &Shared) {
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    while Instant::now() < deadline {
        let drained = {
            let run = lock(run);
            let seen: BTreeSet<(u32, u64)> = run.seen.iter().map(|(p, o, _)| (*p, *o)).collect();
            run.published.keys().all(|place| seen.contains(place))
                && run
                    .delayed
                    .keys()
                    .all(|payload| run.delayed_seen.contains_key(payload))
        };
        if drained {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The group's part of the report, with `failovers` (kills of the coordinator, from the kill
/// to the next answered commit); whether it found anything wrong.
fn report(run: &Shared, failovers: &Histogram<u64>) -> (Value, bool) {
    let run = lock(run);
    let seen: BTreeSet<(u32, u64)> = run.seen.iter().map(|(p, o, _)| (*p, *o)).collect();
    let not_delivered = run
        .published
        .keys()
        .filter(|place| !seen.contains(place))
        .count();
    let unknown_seen = run
        .seen
        .iter()
        .filter(|(partition, offset, payload)| {
            run.published.get(&(*partition, *offset)) != Some(payload)
        })
        .count();
    let delayed_lost = run
        .delayed
        .keys()
        .filter(|payload| !run.delayed_seen.contains_key(*payload))
        .count();
    // Before the answered time: wrong, unless the publish was resent and the first delivery
    // came after its first try's time (a try whose answer was lost stored a copy due then;
    // counted in `delayed_twice` too). Before the first try's time is always wrong.
    let seen_before = |payload: &Vec<u8>, due_ms: u64| {
        run.delayed_seen
            .get(payload)
            .is_some_and(|(seen_ms, _)| *seen_ms < due_ms)
    };
    let delay_ms = u64::try_from(DELAY.as_millis()).unwrap_or(u64::MAX);
    let delayed_early = run
        .delayed
        .iter()
        .filter(|(payload, publish)| {
            seen_before(payload, publish.first_sent_ms + delay_ms)
                || (!publish.resent && seen_before(payload, publish.due_ms))
        })
        .count();
    let delayed_by_an_earlier_try = run
        .delayed
        .iter()
        .filter(|(payload, publish)| {
            publish.resent
                && seen_before(payload, publish.due_ms)
                && !seen_before(payload, publish.first_sent_ms + delay_ms)
        })
        .count();
    let delayed_twice = run
        .delayed_seen
        .values()
        .filter(|(_, times)| *times > 1)
        .count();
    let wrong = run.commit_redelivered > 0
        || not_delivered > 0
        || unknown_seen > 0
        || delayed_lost > 0
        || delayed_early > 0;
    let report = json!({
        "published": run.published.len(),
        "publishes_resent": run.resent,
        "delivered": run.delivered,
        "rejoined": run.rejoined,
        "commits_answered": run.commits_answered,
        "commit_redelivered": run.commit_redelivered,
        "not_delivered": not_delivered,
        "unknown_seen": unknown_seen,
        "delayed_published": run.delayed.len(),
        "delayed_lost": delayed_lost,
        "delayed_early": delayed_early,
        "delayed_by_an_earlier_try": delayed_by_an_earlier_try,
        "delayed_twice": delayed_twice,
        "coordinator_kills": failovers.len(),
        "group_failover_ms": super::percentiles_ms(failovers),
    });
    (report, wrong)
}
