//! Mailbox subscriptions: one consumer's stream on one queue. Delivery starts after the
//! consumer's last acked offset, follows appends as they happen (a [`Waiters`] registry wakes the
//! stream when its queue grows, so nothing polls), and never goes past the credits the client
//! granted, so a slow consumer costs bounded server memory. Acks are cumulative; each is written
//! through the store's log as a record in the consumer's position queue, so a restart
//! redelivers nothing that was acked.

use std::hash::BuildHasher;
use std::pin::pin;
use std::sync::Arc;

use levee_proto::WireError;
use levee_proto::v1::subscribe_request::Kind;
use levee_proto::v1::{
    Credit, Delivery, ErrorCode, SubscribeRequest, SubscribeResponse, SubscribeStart,
};
use levee_store::Store;
use tokio::sync::Notify;

use levee_broker::names::{self, POSITION_PREFIX};
use levee_broker::position::{decode_queue_position, encode_queue_position};

use crate::queue::credit::{ROUND_BYTES_MAX, ROUND_MESSAGES_MAX, StreamCredit, check_credit};
use crate::queue::invalid;
use crate::queue::name_error;
use crate::queue::stream::{Incoming, Outgoing};

/// The name of the queue holding `consumer`'s acked positions on `queue`.
pub(crate) fn position_queue(consumer: &str, queue: &[u8]) -> Vec<u8> {
    let hash = foldhash::fast::FixedState::with_seed(0x706f_7369_7469_6f6e).hash_one(queue);
    let mut name = POSITION_PREFIX.to_vec();
    name.extend_from_slice(consumer.as_bytes());
    name.push(0);
    name.extend_from_slice(format!("{hash:016x}").as_bytes());
    name
}

/// The consumer's next offset on `queue`: after its last ack, or 0. Blocks on the store (it
/// may wait for a commit round, see [`crate::queue::last_record`]): call it on the blocking pool.
pub(crate) fn load_position(store: &Store, consumer: &str, queue: &[u8]) -> Result<u64, WireError> {
    let Some(record) = crate::queue::last_record(store, &position_queue(consumer, queue))? else {
        return Ok(0);
    };
    decode_queue_position(&record, queue).map_err(|_| {
        WireError::new(
            ErrorCode::FailedPrecondition,
            format!(
                "consumer '{consumer}': its position record does not match this queue; use \
                 another consumer name"
            ),
        )
    })
}

/// Checks the start message: queue name, consumer name, credit.
pub fn check_start(start: &SubscribeStart) -> Result<(), WireError> {
    check_queue_name(&start.queue)?;
    check_consumer_and_credit(&start.consumer, start.credit.as_ref())
}

/// Checks a subscribed queue's name: 1 to [`names::QUEUE_NAME_BYTES_MAX`] bytes, not reserved.
pub(crate) fn check_queue_name(queue: &[u8]) -> Result<(), WireError> {
    names::check_queue_name(queue).map_err(|error| name_error(&error))
}

/// Checks a subscription's consumer name and initial credit.
pub(crate) fn check_consumer_and_credit(
    consumer: &str,
    credit: Option<&Credit>,
) -> Result<(), WireError> {
    names::check_consumer_name(consumer).map_err(|error| name_error(&error))?;
    check_credit(credit)
}

/// One subscription's state.
#[derive(Debug)]
pub struct Session {
    /// Store calls (reads inline, acks' durability awaited without a thread).
    pub calls: crate::queue::StoreCalls,
    /// Wakes this session when its queue grows.
    pub notify: Arc<Notify>,
    /// Who waits on which queue: says when a queue was deleted through its shard's log.
    pub waiters: Arc<crate::queue::waiters::Waiters>,
    /// Consumers' position logs (`SubscribeMany` acks), read with the position queue.
    pub positions: Arc<crate::queue::mailbox::position_log::PositionLogs>,
    /// The cluster's shards, through which acks go when it replicates its queues.
    pub replication: Option<crate::queue::replicated::Replication>,
    /// The client's start message (already checked).
    pub start: SubscribeStart,
    /// The client's further messages.
    pub incoming: Incoming<SubscribeRequest>,
    /// Where responses go.
    pub outgoing: Outgoing<SubscribeResponse>,
    /// Delivered messages, counted in metrics.
    pub delivered: prometheus_client::metrics::counter::Counter,
    /// Turns true when the server shuts down.
    pub closing: tokio::sync::watch::Receiver<bool>,
}

impl Session {
    /// Runs the subscription until the client leaves or breaks the protocol.
    pub async fn run(mut self) {
        if let Err(error) = self.serve().await {
            self.outgoing.fail(error).await;
        }
    }

    async fn serve(&mut self) -> Result<(), WireError> {
        let (queue, consumer) = (self.start.queue.clone(), self.start.consumer.clone());
        let replicated =
            crate::queue::replicated::Replication::groups_if_replicated(self.replication.as_ref())?;
        let queues = [queue.clone().into_boxed_slice()];
        // Before the positions are read: a replicated delete applied from now on ends the
        // stream (its position may predate the delete's forget).
        let deletes_seen = self.waiters.deletes_seen();
        if let Some(groups) = &replicated {
            // Every ack confirmed anywhere before is applied here before the position is read.
            crate::queue::replicated::Replication::barrier(groups, &queues).await?;
        }
        let position = {
            // The larger of this queue's position queue and the consumer's position log, so a
            // consumer may move a queue between single and many-queue streams.
            let log = self.positions.open(&consumer);
            self.calls
                .run(move |_| Ok(log.positions(&queues)?[0]))
                .await?
        };
        let next = position.next;
        let mut progress = Progress {
            next,
            acked: next,
            epoch: position.epoch,
            replicated,
            credit: StreamCredit::initial(self.start.credit),
            writer_noted: false,
            deletes_seen,
            moves_seen: u64::MAX,
        };
        let start = SubscribeResponse {
            start_offset: Some(next),
            deliveries: Vec::new(),
            acked_offset: next,
        };
        if !self.outgoing.send(start).await {
            return Ok(());
        }
        loop {
            let notify = Arc::clone(&self.notify);
            let mut woken = pin!(notify.notified());
            // Registered before the read, so an append between the read and the wait still wakes.
            woken.as_mut().enable();
            match self.deliver(&mut progress).await? {
                // Nothing more to read until the next append, which wakes `woken` (enabled
                // before the read): no second read to find that out.
                Delivered::Some { caught_up: true } | Delivered::Nothing => {}
                Delivered::Some { caught_up: false } => continue,
                Delivered::ClientGone => return Ok(()),
            }
            let mut closing = self.closing.clone();
            let message = tokio::select! {
                () = &mut woken => continue,
                message = self.incoming.message() => message,
                _ = closing.wait_for(|closing| *closing) => {
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        "server shutting down; subscribe again, to this server once it is back \
                         or to another",
                    ));
                }
            };
            // A transport error (a message over the size limit) ends the stream with it.
            let Some(message) = message? else {
                return Ok(());
            };
            self.handle(message, &mut progress).await?;
        }
    }

    /// Sends what the credit allows from the next offset.
    async fn deliver(&mut self, progress: &mut Progress) -> Result<Delivered, WireError> {
        if progress.replicated.is_some() && self.waiters.deletes_seen() != progress.deletes_seen {
            let queue = &self.start.queue;
            progress.deletes_seen =
                super::check_not_deleted(&self.waiters, progress.deletes_seen, |deleted| {
                    deleted == &queue[..]
                })?;
        }
        if let Some(groups) = &progress.replicated {
            progress.moves_seen = crate::queue::replicated::Replication::check_still_held(
                groups,
                &self.waiters,
                progress.moves_seen,
                std::iter::once(&self.start.queue[..]),
            )?;
        }
        if !progress.credit.is_open() {
            return Ok(Delivered::Nothing);
        }
        let (queue, from) = (&self.start.queue, progress.next);
        let count = progress.credit.messages.min(ROUND_MESSAGES_MAX) as usize;
        let bytes = progress.credit.bytes.min(ROUND_BYTES_MAX) as usize;
        let batch = self
            .calls
            .store
            .read(queue, from, count, bytes)
            .map_err(|error| WireError::new(ErrorCode::StorageFailed, error.to_string()))?;
        if batch.is_empty() {
            if batch.skipped_to_first_retained {
                progress.next = batch.first_offset;
            }
            return Ok(Delivered::Nothing);
        }
        let sent_bytes = batch.bytes();
        let first_offset = batch.first_offset;
        let next_offset = batch.next_offset();
        let caught_up = next_offset >= batch.visible_end_offset;
        let deliveries: Vec<Delivery> = crate::queue::payloads(batch)
            .zip(first_offset..)
            .map(|(payload, offset)| Delivery { offset, payload })
            .collect();
        progress.credit.spend(deliveries.len(), sent_bytes);
        progress.next = next_offset;
        self.delivered.inc_by(deliveries.len() as u64);
        let response = SubscribeResponse {
            start_offset: None,
            deliveries,
            acked_offset: 0,
        };
        if !self.outgoing.send(response).await {
            return Ok(Delivered::ClientGone);
        }
        Ok(Delivered::Some { caught_up })
    }

    /// Applies a credit or an ack from the client.
    async fn handle(
        &mut self,
        message: SubscribeRequest,
        progress: &mut Progress,
    ) -> Result<(), WireError> {
        match message.kind {
            Some(Kind::Credit(credit)) => {
                progress.credit.grant(credit);
                Ok(())
            }
            Some(Kind::Ack(ack)) => {
                if ack.offset >= progress.next {
                    return Err(super::ack_past_delivered(
                        "this stream",
                        ack.offset,
                        progress.next,
                    ));
                }
                if ack.offset >= progress.acked
                    && let Some(groups) = &progress.replicated
                {
                    // Through the queue's shard, into the consumer's position log on every
                    // replica.
                    let position = levee_cluster::shard::ConsumerPosition {
                        queue: levee_proto::Bytes::copy_from_slice(&self.start.queue),
                        epoch: progress.epoch,
                        next: ack.offset + 1,
                    };
                    crate::queue::replicated::Replication::record_positions(
                        groups,
                        &self.start.consumer,
                        vec![position],
                    )
                    .await?;
                    progress.acked = ack.offset + 1;
                } else if ack.offset >= progress.acked {
                    progress.acked = ack.offset + 1;
                    let queue = &self.start.queue;
                    if !progress.writer_noted {
                        self.positions.note_writer(&self.start.consumer);
                        progress.writer_noted = true;
                    }
                    let name = position_queue(&self.start.consumer, queue);
                    let record = encode_queue_position(progress.acked, queue);
                    let (_, ticket) = self
                        .calls
                        .store
                        .append_deferred(&name, &record)
                        .map_err(crate::queue::write_error)?;
                    self.calls.durable(Some(ticket)).await?;
                }
                // Durable now (or already before): say so.
                let answer = SubscribeResponse {
                    start_offset: None,
                    deliveries: Vec::new(),
                    acked_offset: progress.acked,
                };
                let _ = self.outgoing.send(answer).await;
                Ok(())
            }
            Some(Kind::Start(_)) | None => {
                Err(invalid("a subscription takes one start message".to_owned()))
            }
        }
    }
}

/// Where a subscription stands.
#[derive(Debug)]
struct Progress {
    /// The next offset to deliver.
    next: u64,
    /// The offset after the last acked one (what a new subscription starts from).
    acked: u64,
    credit: StreamCredit,
    /// Whether the consumer was noted as a writer of positions (before its first ack).
    writer_noted: bool,
    /// The queue's delete epoch the position belongs to.
    epoch: u64,
    /// The shard groups acks go through, when the cluster replicates its queues.
    replicated: Option<levee_cluster::shard::ShardGroups>,
    /// Replicated deletes this stream has looked at (see `Waiters::deleted_since`).
    deletes_seen: u64,
    /// Shard moves off this node this stream has looked at (see `Waiters::shards_moved`;
    /// `u64::MAX` until the first look).
    moves_seen: u64,
}

/// What one delivery attempt did.
enum Delivered {
    /// Sent some; `caught_up`: the read reached the end of what was visible.
    Some {
        caught_up: bool,
    },
    Nothing,
    ClientGone,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::retention::trim_positions;

    #[test]
    fn given_an_ack_not_yet_fsynced_under_always_then_loading_the_position_waits_for_it() {
        let directory = tempfile::tempdir().unwrap();
        let options = levee_store::StoreOptions {
            sync: levee_store::SyncPolicy::Always,
            ..levee_store::StoreOptions::default()
        };
        let (store, _) = Store::open(directory.path(), options).unwrap();
        let name = position_queue("app", b"orders");
        store
            .append(&name, &encode_queue_position(3, b"orders"))
            .unwrap();
        // The next ack is buffered and nobody waits for its round: under `always` a reader
        // does not see it yet, but its queue's next offset already counts it.
        store
            .append_deferred(&name, &encode_queue_position(7, b"orders"))
            .unwrap();
        assert_eq!(load_position(&store, "app", b"orders").unwrap(), 7);
        assert_eq!(load_position(&store, "other", b"orders").unwrap(), 0);
        // A record of another queue (a hash collision) is still refused.
        store
            .append(&name, &encode_queue_position(9, b"not orders"))
            .unwrap();
        let error = load_position(&store, "app", b"orders").unwrap_err();
        assert!(
            error.message.contains("use another consumer name"),
            "{error:?}"
        );
    }

    #[test]
    fn given_many_acks_when_positions_are_trimmed_then_the_queue_shrinks_and_keeps_the_last() {
        let directory = tempfile::tempdir().unwrap();
        let options = levee_store::StoreOptions {
            sync: levee_store::SyncPolicy::Interval { interval_ms: 5 },
            ..levee_store::StoreOptions::default()
        };
        let (store, _) = Store::open(directory.path(), options).unwrap();
        store.append(b"orders", b"not a position").unwrap();
        let name = position_queue("app", b"orders");
        let ack = |from: u64, to: u64| {
            for next in from..=to {
                store
                    .append(&name, &encode_queue_position(next, b"orders"))
                    .unwrap();
                if next % 500 == 0 {
                    store.sync().unwrap();
                }
            }
            store.sync().unwrap();
        };
        let retained = || {
            let info = store.queue_info(&name).unwrap().unwrap();
            info.next_offset - info.first_offset
        };
        ack(1, 5_000);
        assert!(trim_positions(&store, 0).unwrap() > 0);
        let after_first = retained();
        assert!(after_first < 5_000);
        assert_eq!(
            trim_positions(&store, 0).unwrap(),
            0,
            "already within the bound"
        );
        // Ten times more acks: the queue stays about as small (bounded, not growing).
        ack(5_001, 50_000);
        trim_positions(&store, 0).unwrap();
        assert!(
            retained() <= after_first + 500,
            "{} > {after_first} + one chunk",
            retained()
        );
        assert_eq!(load_position(&store, "app", b"orders").unwrap(), 50_000);
        // Other queues are untouched.
        assert_eq!(
            store.queue_info(b"orders").unwrap().unwrap().first_offset,
            0
        );
    }
}
