//! Messages that wait for their time (a group's retries, delayed publishes), over the store:
//! the broker's [`DelayWheel`] says which slot each goes to and which slots are due; this
//! module appends [`DelayedEntry`] records to the slots' queues; a task, every [`FINE_MS`],
//! delivers the due fine slots (each entry's body appended to its target queue, the target's
//! topic woken), and another, every 100 ms, spreads due coarse slots into fine ones. A slot's queue is deleted
//! only once what it held is durable elsewhere, so a crash delivers an entry twice at worst,
//! never loses one. At start the slots are found again from the store's queue names.
//!
//! In a cluster that replicates its queues nothing waits here: every entry is written through
//! its target's shard ([`Delayer::append_through_shards`], `ShardCommand::Delay`), which keeps
//! its own slots on every replica and whose leader delivers them when due (docs/CLUSTER.md,
//! "Retries and delayed messages through the shards"). Slots this node kept before (written
//! by an older version) are still delivered, through the shards.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use levee_broker::delay::{DelayWheel, DelayedEntry, Due, FINE_MS, Placement, Slot};
use levee_broker::names::DELAY_PREFIX;
use levee_proto::WireError;
use levee_store::{CommitTicket, Store};
use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::queue::topic::consume::topic_wake_key;
use crate::queue::waiters::Waiters;
use crate::queue::{StoreCalls, lock, storage_error, write_error};

/// Messages one read of a slot takes.
const SLOT_READ_MESSAGES: usize = 10_000;
/// Bytes one read of a slot takes.
const SLOT_READ_BYTES: usize = 4 << 20;
/// How often due coarse slots are spread (they are taken 30 s ahead of their span).
const SPREAD_INTERVAL: Duration = Duration::from_millis(100);

/// Milliseconds since the Unix epoch, by this server's clock.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// What [`Delayer::schedule`] buffered: wait for `ticket`, write `through_shards` (see
/// [`Delayer::append_through_shards`]), then wake `topics` (entries due at once went straight
/// to their queues, or are in `through_shards`).
#[derive(Debug, Default)]
pub struct Scheduled {
    /// Makes the appends durable.
    pub ticket: Option<CommitTicket>,
    /// Topics whose consumers to wake once durable.
    pub topics: Vec<String>,
    /// In a cluster that replicates its queues: every entry, to write through its target's
    /// shard.
    pub through_shards: Vec<DelayedEntry>,
}

/// Every waiting message of the server; see the module docs.
#[derive(Debug)]
pub struct Delayer {
    calls: StoreCalls,
    waiters: Arc<Waiters>,
    metrics: Metrics,
    wheel: Mutex<DelayWheel>,
    /// Raised each time retries became readable in groups' retry queues: a consume stream
    /// reads its retry queues only when this moved since it last found them empty.
    retry_generation: std::sync::atomic::AtomicU64,
    /// In a cluster that replicates its queues, every entry goes through its target's shard
    /// (a group's retry queues and the shards' delay slots are replicated).
    replication: Option<crate::queue::replicated::Replication>,
}

impl Delayer {
    /// The delayer, with the slots the store holds (a pass over its queue names with the
    /// delay prefix). Blocks on the store.
    pub fn open(calls: StoreCalls, waiters: Arc<Waiters>, metrics: Metrics) -> Self {
        let mut wheel = DelayWheel::default();
        let store = &calls.store;
        let mut found = Vec::new();
        store.for_each_queue_with_prefix(DELAY_PREFIX, |name| found.push(name.to_vec()));
        for name in found {
            if let (Some(slot), Ok(Some(info))) = (Slot::parse(&name), store.queue_info(&name)) {
                wheel.restore(slot, info.next_offset - info.first_offset);
            }
        }
        metrics
            .delayed_messages_waiting
            .set(i64::try_from(wheel.pending()).unwrap_or(i64::MAX));
        if wheel.pending() > 0 {
            tracing::info!(
                waiting = wheel.pending(),
                slots = wheel.slots(),
                "delayed messages found"
            );
        }
        Self {
            calls,
            waiters,
            metrics,
            wheel: Mutex::new(wheel),
            retry_generation: std::sync::atomic::AtomicU64::new(0),
            replication: None,
        }
    }

    /// The delayer of a node of a cluster: entries go through their targets' shards when
    /// `replication` says the cluster replicates its queues.
    #[must_use]
    pub fn with_replication(mut self, replication: crate::queue::replicated::Replication) -> Self {
        self.replication = Some(replication);
        self
    }

    /// Whether this node's queues are replicated (its shards opened or opening).
    fn shards_open(&self) -> bool {
        self.replication
            .as_ref()
            .and_then(crate::queue::replicated::Replication::groups)
            .is_some()
    }

    /// The shard groups when due entries go through them.
    fn shards(&self) -> Result<Option<levee_cluster::shard::ShardGroups>, WireError> {
        crate::queue::replicated::Replication::groups_if_replicated(self.replication.as_ref())
    }

    /// Writes `entries` through their targets' shards (see
    /// [`crate::queue::replicated::Replication::delay_records`]), then says the retries are
    /// readable; each entry's offset in its target when it was due at once, 0 when it waits.
    pub async fn append_through_shards(
        &self,
        entries: Vec<DelayedEntry>,
    ) -> Result<Vec<u64>, WireError> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let offsets = crate::queue::replicated::Replication::delay_records(
            self.replication.as_ref(),
            &entries,
            unix_ms(),
        )
        .await?;
        self.retries_visible();
        Ok(offsets)
    }

    /// Says that retries appended to retry queues are now readable (durable under
    /// `always`): call it after their flush or durable wait, before waking their consumers.
    pub fn retries_visible(&self) {
        self.retry_generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Counts entries delivered at `now_ms` whose due times were `due_ms` (by a shard this
    /// node replicates).
    pub fn count_delivered(&self, now_ms: u64, due_ms: &[u64]) {
        for &due in due_ms {
            let late = Duration::from_millis(now_ms.saturating_sub(due));
            self.metrics
                .delayed_delivery_lateness_seconds
                .observe(late.as_secs_f64());
        }
        self.metrics
            .delayed_messages_delivered
            .inc_by(due_ms.len() as u64);
    }

    /// The count [`Delayer::retries_visible`] raises.
    pub fn retry_generation(&self) -> u64 {
        self.retry_generation
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Buffers `entries` at `now_ms`: each into its slot's queue, or, when due, its body into
    /// its target queue. Wait for the returned ticket before answering, then wake its topics.
    pub fn schedule(&self, entries: &[DelayedEntry], now_ms: u64) -> Result<Scheduled, WireError> {
        let scheduled = self.place(entries, now_ms)?;
        self.metrics
            .delayed_messages_scheduled
            .inc_by(entries.len() as u64);
        Ok(scheduled)
    }

    /// [`Delayer::schedule`] without counting the entries as newly scheduled.
    fn place(&self, entries: &[DelayedEntry], now_ms: u64) -> Result<Scheduled, WireError> {
        let mut scheduled = Scheduled::default();
        if entries.is_empty() {
            return Ok(scheduled);
        }
        if self.shards()?.is_some() {
            for entry in entries {
                if entry.due_ms <= now_ms && !scheduled.topics.contains(&entry.topic) {
                    scheduled.topics.push(entry.topic.clone());
                }
            }
            scheduled.through_shards = entries.to_vec();
            return Ok(scheduled);
        }
        let mut encoded = Vec::with_capacity(entries.len());
        let mut wheel = lock(&self.wheel);
        for entry in entries {
            match wheel.place(entry.due_ms, now_ms) {
                Placement::Now => {
                    encoded.push((entry.target.clone(), entry.body.clone()));
                    if !scheduled.topics.contains(&entry.topic) {
                        scheduled.topics.push(entry.topic.clone());
                    }
                }
                Placement::Slot(slot) => encoded.push((slot.queue(), entry.encode())),
            }
        }
        let batch: Vec<(&[u8], &[u8])> = encoded
            .iter()
            .map(|(queue, body)| (queue.as_slice(), body.as_slice()))
            .collect();
        // Under the wheel's lock, so a slot taken for delivery never gains an entry after.
        let (_, ticket) = self
            .calls
            .store
            .append_batch_deferred(&batch)
            .map_err(write_error)?;
        let waiting = wheel.pending();
        drop(wheel);
        self.metrics
            .delayed_messages_waiting
            .set(i64::try_from(waiting).unwrap_or(i64::MAX));
        scheduled.ticket = Some(ticket);
        Ok(scheduled)
    }

    fn wake(&self, topics: &[String]) {
        for topic in topics {
            self.waiters.wake(&topic_wake_key(topic));
        }
    }

    /// Messages waiting now.
    pub fn waiting(&self) -> u64 {
        let shards = self
            .replication
            .as_ref()
            .and_then(crate::queue::replicated::Replication::groups)
            .and_then(Result::ok)
            .map_or(0, levee_cluster::shard::ShardGroups::delayed_waiting);
        lock(&self.wheel).pending() + shards
    }

    /// Delivers due fine slots every [`FINE_MS`], and spreads due coarse slots every
    /// [`SPREAD_INTERVAL`] on a task of its own (a large coarse slot takes a while and must
    /// not hold up deliveries), until the server closes. A failed pass (a full disk) is logged
    /// and its slots are tried again a second later.
    pub async fn run(self: Arc<Self>, closing: watch::Receiver<bool>) {
        let spreading = tokio::spawn(Arc::clone(&self).run_level(
            closing.clone(),
            SPREAD_INTERVAL,
            |wheel, now| Due {
                spread: wheel.take_spread(now),
                deliver: Vec::new(),
            },
        ));
        let every = Duration::from_millis(FINE_MS);
        Arc::clone(&self)
            .run_level(closing, every, |wheel, now| Due {
                spread: Vec::new(),
                deliver: wheel.take_deliver(now),
            })
            .await;
        let _ = spreading.await;
    }

    /// Every `every`, takes what `take` says is due and processes it.
    async fn run_level(
        self: Arc<Self>,
        mut closing: watch::Receiver<bool>,
        every: Duration,
        take: impl Fn(&mut DelayWheel, u64) -> Due,
    ) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = closing.wait_for(|closing| *closing) => return,
            }
            let due = take(&mut lock(&self.wheel), unix_ms());
            if due.is_empty() {
                if self.shards_open() {
                    // The shards' slots this node leads change without this node's wheel.
                    self.metrics
                        .delayed_messages_waiting
                        .set(i64::try_from(self.waiting()).unwrap_or(i64::MAX));
                }
                continue;
            }
            // In a replicated cluster never the local path, even while the shards open.
            let replicated = self.shards_open();
            let failed = if replicated {
                Ok(Arc::clone(&self).through_shards(due).await)
            } else {
                let delayer = Arc::clone(&self);
                self.calls
                    .run(move |store| Ok(delayer.process(store, &due)))
                    .await
            };
            match failed {
                Ok(Ok(())) => {}
                Ok(Err((error, left))) => {
                    tracing::warn!(%error, "delivering delayed messages failed; retrying in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    self.restore_slots(&left);
                }
                Err(error) => tracing::warn!(%error, "delivering delayed messages failed"),
            }
            self.metrics
                .delayed_messages_waiting
                .set(i64::try_from(self.waiting()).unwrap_or(i64::MAX));
        }
    }

    /// Puts slots whose pass failed back into the wheel (their queues are still there).
    fn restore_slots(&self, due: &Due) {
        let store = &self.calls.store;
        let mut wheel = lock(&self.wheel);
        let slots = due
            .spread
            .iter()
            .map(|&number| Slot::Coarse(number))
            .chain(due.deliver.iter().map(|&number| Slot::Fine(number)));
        for slot in slots {
            if let Ok(Some(info)) = store.queue_info(&slot.queue()) {
                wheel.restore(slot, info.next_offset - info.first_offset);
            }
        }
    }

    /// One pass over the due slots (blocks on the store): spreads the coarse ones, delivers
    /// the fine ones, wakes their consumers and deletes each slot once its entries are durable
    /// elsewhere. A failure returns the error with the slots not done (a slot delivered but
    /// not deleted is delivered again: at-least-once).
    fn process(&self, store: &Store, due: &Due) -> Result<(), (WireError, Due)> {
        // What was appended to the slots must be readable (fsynced under `always`).
        store
            .flush()
            .map_err(|error| (write_error(error), due.clone()))?;
        for (index, &coarse) in due.spread.iter().enumerate() {
            let left = || Due {
                spread: due.spread[index..].to_vec(),
                deliver: due.deliver.clone(),
            };
            self.spread(store, Slot::Coarse(coarse))
                .map_err(|error| (error, left()))?;
        }
        // Every due slot's entries go to their targets, one flush makes them all durable (and
        // readable), their consumers are woken, and only then are the slots deleted.
        let mut topics = Vec::new();
        for &fine in &due.deliver {
            self.deliver(store, Slot::Fine(fine), &mut topics)
                .map_err(|error| (error, due.clone()))?;
        }
        store
            .flush()
            .map_err(|error| (write_error(error), due.clone()))?;
        self.retries_visible();
        self.wake(&topics);
        for (index, &fine) in due.deliver.iter().enumerate() {
            store
                .delete_queue(&Slot::Fine(fine).queue())
                .map_err(|error| {
                    let left = Due {
                        spread: Vec::new(),
                        deliver: due.deliver[index..].to_vec(),
                    };
                    (write_error(error), left)
                })?;
        }
        Ok(())
    }

    /// [`Delayer::process`] in a cluster that replicates its queues, slot by slot: a due
    /// coarse slot's entries are placed again (those due at once collected), a due fine slot's
    /// entries collected (blocking); what was collected is appended to its targets through
    /// their shards, the consumers woken, and only then the slot deleted. A failure returns
    /// the slots not done (a slot done again delivers its entries again: at least once).
    async fn through_shards(self: Arc<Self>, due: Due) -> Result<(), (WireError, Due)> {
        let slots = due
            .spread
            .iter()
            .map(|&coarse| Slot::Coarse(coarse))
            .chain(due.deliver.iter().map(|&fine| Slot::Fine(fine)))
            .collect::<Vec<_>>();
        for (index, slot) in slots.iter().copied().enumerate() {
            let left = || Due {
                spread: due.spread.iter().copied().skip(index).collect(),
                deliver: due
                    .deliver
                    .iter()
                    .copied()
                    .skip(index.saturating_sub(due.spread.len()))
                    .collect(),
            };
            self.slot_through_shards(slot)
                .await
                .map_err(|error| (error, left()))?;
        }
        Ok(())
    }

    /// One slot of [`Delayer::through_shards`].
    async fn slot_through_shards(self: &Arc<Self>, slot: Slot) -> Result<(), WireError> {
        let delayer = Arc::clone(self);
        let (targets, topics) = self
            .calls
            .run(move |store| {
                // What was appended to the slots must be readable (fsynced under `always`).
                store.flush().map_err(write_error)?;
                let (mut targets, mut topics) = (Vec::new(), Vec::new());
                Self::read_slot(store, slot, |entries| {
                    if let Slot::Coarse(_) = slot {
                        // Counted as scheduled when first placed.
                        let placed = delayer.place(&entries, unix_ms())?;
                        targets.extend(placed.through_shards);
                        topics.extend(placed.topics);
                        return Ok(());
                    }
                    let now = unix_ms();
                    for entry in entries {
                        let late = Duration::from_millis(now.saturating_sub(entry.due_ms));
                        delayer
                            .metrics
                            .delayed_delivery_lateness_seconds
                            .observe(late.as_secs_f64());
                        delayer.metrics.delayed_messages_delivered.inc();
                        if !topics.contains(&entry.topic) {
                            topics.push(entry.topic.clone());
                        }
                        targets.push(entry);
                    }
                    Ok(())
                })?;
                // The entries placed again must be durable before the slot goes.
                store.flush().map_err(write_error)?;
                Ok((targets, topics))
            })
            .await?;
        self.append_through_shards(targets).await?;
        self.retries_visible();
        self.wake(&topics);
        self.calls
            .run(move |store| {
                store
                    .delete_queue(&slot.queue())
                    .map(|_| ())
                    .map_err(write_error)
            })
            .await
    }

    /// Calls `each` on every page of entries of `slot`'s queue.
    fn read_slot(
        store: &Store,
        slot: Slot,
        mut each: impl FnMut(Vec<DelayedEntry>) -> Result<(), WireError>,
    ) -> Result<(), WireError> {
        let queue = slot.queue();
        let Some(info) = store
            .queue_info(&queue)
            .map_err(|error| storage_error(&error))?
        else {
            return Ok(());
        };
        let mut offset = info.first_offset;
        while offset < info.next_offset {
            let batch = store
                .read(&queue, offset, SLOT_READ_MESSAGES, SLOT_READ_BYTES)
                .map_err(|error| storage_error(&error))?;
            if batch.is_empty() {
                break;
            }
            offset = batch.next_offset();
            let entries = batch
                .iter()
                .filter_map(|bytes| {
                    let entry = DelayedEntry::decode(bytes);
                    if entry.is_none() {
                        tracing::warn!(?slot, "a delayed entry is unreadable; skipped");
                    }
                    entry
                })
                .collect();
            each(entries)?;
        }
        Ok(())
    }

    /// Places every entry of a coarse slot again (into fine slots), then deletes it.
    fn spread(&self, store: &Store, slot: Slot) -> Result<(), WireError> {
        let mut topics = Vec::new();
        Self::read_slot(store, slot, |entries| {
            // Counted as scheduled when first placed.
            let placed = self.place(&entries, unix_ms())?;
            topics.extend(placed.topics);
            Ok(())
        })?;
        store.flush().map_err(write_error)?;
        self.retries_visible();
        self.wake(&topics);
        store.delete_queue(&slot.queue()).map_err(write_error)?;
        Ok(())
    }

    /// Appends every entry of a fine slot to its target (not yet durable: the caller flushes,
    /// then deletes the slot).
    fn deliver(
        &self,
        store: &Store,
        slot: Slot,
        topics: &mut Vec<String>,
    ) -> Result<(), WireError> {
        Self::read_slot(store, slot, |entries| {
            let now = unix_ms();
            let batch: Vec<(&[u8], &[u8])> = entries
                .iter()
                .map(|entry| (entry.target.as_slice(), entry.body.as_slice()))
                .collect();
            store.append_batch_deferred(&batch).map_err(write_error)?;
            for entry in &entries {
                let late_ms = now.saturating_sub(entry.due_ms);
                self.metrics
                    .delayed_delivery_lateness_seconds
                    .observe(Duration::from_millis(late_ms).as_secs_f64());
                if !topics.contains(&entry.topic) {
                    topics.push(entry.topic.clone());
                }
            }
            self.metrics
                .delayed_messages_delivered
                .inc_by(entries.len() as u64);
            Ok(())
        })
    }
}
