//! Mailbox subscriptions: one consumer's stream on one queue. Delivery starts after the
//! consumer's last acked offset, follows appends as they happen (a [`Waiters`] registry wakes the
//! stream when its queue grows, so nothing polls), and never goes past the credits the client
//! granted, so a slow consumer costs bounded server memory. Acks are cumulative; each is written
//! through the store's log as a record in the consumer's position queue, so a restart
//! redelivers nothing that was acked.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::pin::pin;
use std::sync::{Arc, Mutex, Weak};

use levee_proto::WireError;
use levee_proto::v1::subscribe_request::Kind;
use levee_proto::v1::{
    Credit, Delivery, ErrorCode, SubscribeRequest, SubscribeResponse, SubscribeStart,
};
use levee_store::Store;
use tokio::sync::{Notify, mpsc};
use tonic::{Status, Streaming};

use super::lock;

/// First byte of every queue name the server keeps for itself; clients may not use it.
pub const RESERVED_PREFIX: u8 = 0;
/// Most bytes in a consumer name.
pub const CONSUMER_BYTES_MAX: usize = 64;
/// Most messages of credit a subscription may hold.
pub const CREDIT_MESSAGES_MAX: u32 = 100_000;
/// Most payload bytes of credit a subscription may hold.
pub const CREDIT_BYTES_MAX: u32 = 64 << 20;
/// Byte credit of a start that does not say.
pub const CREDIT_BYTES_DEFAULT: u32 = 4 << 20;
/// Most messages one read for a subscription takes from the store.
const READ_MESSAGES_MAX: u32 = 1_000;
/// Most payload bytes one delivery response carries (a message may pass it alone; messages are
/// at most 4 MiB), well under the 16 MiB gRPC message limit whatever the byte credit.
pub const ROUND_BYTES_MAX: u32 = 4 << 20;
/// Responses queued for one subscription's stream.
pub const RESPONSES_QUEUED_MAX: usize = 16;
/// Subscriptions open at once on one server.
pub const SUBSCRIPTIONS_MAX: usize = 100_000;
/// Bytes a consumer's position queue keeps when trimmed: every ack appends one small record,
/// so the queue is trimmed from the front down to this size (its last chunk, which holds the
/// newest position, is far smaller and always stays).
pub const POSITION_QUEUE_BYTES_MAX: u64 = 64 << 10;
/// How often position queues are trimmed.
pub const POSITION_TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);
/// The prefix of every position queue's name.
const POSITION_PREFIX: &[u8] = b"\0position\0";

/// Who waits on which queue: appends wake the subscriptions of the queues they grew.
#[derive(Debug, Default)]
pub struct Waiters {
    queues: Mutex<HashMap<Vec<u8>, Weak<Notify>>>,
}

impl Waiters {
    /// The queue's wake-up, shared by its subscriptions; dropped with the last of them.
    pub fn register(&self, queue: &[u8]) -> Arc<Notify> {
        let mut queues = lock(&self.queues);
        if let Some(notify) = queues.get(queue).and_then(Weak::upgrade) {
            return notify;
        }
        if queues.len() >= SUBSCRIPTIONS_MAX {
            queues.retain(|_, notify| notify.strong_count() > 0);
        }
        let notify = Arc::new(Notify::new());
        queues.insert(queue.to_vec(), Arc::downgrade(&notify));
        notify
    }

    /// Wakes the subscriptions of `queue`, if any.
    pub fn wake(&self, queue: &[u8]) {
        if let Some(notify) = lock(&self.queues).get(queue).and_then(Weak::upgrade) {
            notify.notify_waiters();
        }
    }

    /// Subscriptions' queues registered now (live or not yet pruned).
    pub fn len(&self) -> usize {
        lock(&self.queues).len()
    }

    /// Whether no queue is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn invalid(message: String) -> WireError {
    WireError::new(ErrorCode::InvalidArgument, message)
}

/// The name of the queue holding `consumer`'s acked positions on `queue`.
fn position_queue(consumer: &str, queue: &[u8]) -> Vec<u8> {
    let hash = foldhash::fast::FixedState::with_seed(0x706f_7369_7469_6f6e).hash_one(queue);
    let mut name = POSITION_PREFIX.to_vec();
    name.extend_from_slice(consumer.as_bytes());
    name.push(0);
    name.extend_from_slice(format!("{hash:016x}").as_bytes());
    name
}

/// Trims every server-owned log queue (consumer positions, group commits, idempotent
/// producers' runs) to about [`POSITION_QUEUE_BYTES_MAX`]; only their newest records matter.
/// Other queues are left alone. Blocks on the store: call it on the blocking pool.
pub fn trim_positions(store: &Store, now_ms: u64) -> Result<u64, levee_store::WriteError> {
    enforce_retention(store, now_ms, |_| levee_store::Retention::default())
}

/// One retention pass: server-owned log queues are trimmed to about
/// [`POSITION_QUEUE_BYTES_MAX`], topic partitions are kept, and every other queue gets
/// `rule(name)`. Returns the messages removed. Blocks on the store: call it on the blocking
/// pool.
pub fn enforce_retention(
    store: &Store,
    now_ms: u64,
    rule: impl Fn(&[u8]) -> levee_store::Retention,
) -> Result<u64, levee_store::WriteError> {
    let trimmed_prefixes = [
        POSITION_PREFIX,
        super::group::COMMIT_PREFIX,
        super::producer::PRODUCER_PREFIX,
    ];
    let report = store.enforce_retention(now_ms, |name| {
        if trimmed_prefixes
            .iter()
            .any(|prefix| name.starts_with(prefix))
        {
            levee_store::Retention {
                max_age_ms: None,
                max_bytes: Some(POSITION_QUEUE_BYTES_MAX),
            }
        } else if name.first() == Some(&RESERVED_PREFIX) {
            levee_store::Retention::default()
        } else {
            rule(name)
        }
    })?;
    Ok(report.messages_removed)
}

/// A position record: the next offset to deliver, then the queue's name (to detect a hash
/// collision).
fn position_record(next: u64, queue: &[u8]) -> Vec<u8> {
    let mut record = next.to_le_bytes().to_vec();
    record.extend_from_slice(queue);
    record
}

/// The consumer's next offset on `queue`: after its last ack, or 0.
fn load_position(store: &Store, consumer: &str, queue: &[u8]) -> Result<u64, WireError> {
    let name = position_queue(consumer, queue);
    let storage = |error: String| WireError::new(ErrorCode::StorageFailed, error);
    let Some(info) = store
        .queue_info(&name)
        .map_err(|error| storage(error.to_string()))?
    else {
        return Ok(0);
    };
    if info.next_offset == 0 {
        return Ok(0);
    }
    let batch = store
        .read(&name, info.next_offset - 1, 1, usize::MAX)
        .map_err(|error| storage(error.to_string()))?;
    let record = batch.iter().next().unwrap_or_default();
    match record.split_at_checked(8) {
        Some((next, stored_queue)) if stored_queue == queue => {
            Ok(u64::from_le_bytes(next.try_into().unwrap_or([0; 8])))
        }
        _ => Err(WireError::new(
            ErrorCode::FailedPrecondition,
            format!(
                "consumer '{consumer}': its position record does not match this queue; use another consumer name"
            ),
        )),
    }
}

/// Checks the start message: queue name, consumer name, credit.
pub fn check_start(start: &SubscribeStart) -> Result<(), WireError> {
    if start.queue.is_empty() || start.queue.len() > 255 {
        return Err(invalid(format!(
            "queue name must be 1 to 255 bytes, got {}",
            start.queue.len()
        )));
    }
    if start.queue[0] == RESERVED_PREFIX {
        return Err(invalid(
            "queue names starting with a zero byte are reserved".to_owned(),
        ));
    }
    if start.consumer.is_empty() || start.consumer.len() > CONSUMER_BYTES_MAX {
        return Err(invalid(format!(
            "consumer must be 1 to {CONSUMER_BYTES_MAX} bytes, got {}",
            start.consumer.len()
        )));
    }
    let messages = start.credit.as_ref().map_or(0, |credit| credit.messages);
    if !(1..=CREDIT_MESSAGES_MAX).contains(&messages) {
        return Err(invalid(format!(
            "credit.messages must be 1 to {CREDIT_MESSAGES_MAX}, got {messages}"
        )));
    }
    Ok(())
}

/// One subscription's state.
#[derive(Debug)]
pub struct Session {
    /// Store calls (reads inline, acks' durability awaited without a thread).
    pub calls: super::StoreCalls,
    /// Wakes this session when its queue grows.
    pub notify: Arc<Notify>,
    /// The client's start message (already checked).
    pub start: SubscribeStart,
    /// The client's further messages.
    pub incoming: Streaming<SubscribeRequest>,
    /// Where responses go.
    pub outgoing: mpsc::Sender<Result<SubscribeResponse, Status>>,
    /// Delivered messages, counted in metrics.
    pub delivered: prometheus_client::metrics::counter::Counter,
    /// Turns true when the server shuts down.
    pub closing: tokio::sync::watch::Receiver<bool>,
}

impl Session {
    /// Runs the subscription until the client leaves or breaks the protocol.
    pub async fn run(mut self) {
        if let Err(error) = self.serve().await {
            let _ = self.outgoing.send(Err(Status::from(error))).await;
        }
    }

    async fn serve(&mut self) -> Result<(), WireError> {
        let (queue, consumer) = (self.start.queue.clone(), self.start.consumer.clone());
        let next = load_position(&self.calls.store, &consumer, &queue)?;
        let credit = self.start.credit.unwrap_or_default();
        let bytes = if credit.bytes == 0 {
            CREDIT_BYTES_DEFAULT
        } else {
            credit.bytes
        };
        let mut progress = Progress {
            next,
            acked: next,
            credit_messages: credit.messages,
            credit_bytes: bytes.min(CREDIT_BYTES_MAX),
        };
        let start = SubscribeResponse {
            start_offset: next,
            deliveries: Vec::new(),
            acked_offset: next,
        };
        if self.outgoing.send(Ok(start)).await.is_err() {
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
            let Ok(Some(message)) = message else {
                return Ok(());
            };
            self.handle(message, &mut progress).await?;
        }
    }

    /// Sends what the credit allows from the next offset.
    async fn deliver(&mut self, progress: &mut Progress) -> Result<Delivered, WireError> {
        if progress.credit_messages == 0 || progress.credit_bytes == 0 {
            return Ok(Delivered::Nothing);
        }
        let (queue, from) = (&self.start.queue, progress.next);
        let count = progress.credit_messages.min(READ_MESSAGES_MAX) as usize;
        let bytes = progress.credit_bytes.min(ROUND_BYTES_MAX) as usize;
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
        let sent_bytes = u32::try_from(batch.bytes()).unwrap_or(u32::MAX);
        let first_offset = batch.first_offset;
        let next_offset = batch.next_offset();
        let caught_up = next_offset >= batch.visible_end_offset;
        let deliveries: Vec<Delivery> = super::payloads(batch)
            .zip(first_offset..)
            .map(|(payload, offset)| Delivery { offset, payload })
            .collect();
        let sent = u32::try_from(deliveries.len()).unwrap_or(u32::MAX);
        progress.credit_messages = progress.credit_messages.saturating_sub(sent);
        progress.credit_bytes = progress.credit_bytes.saturating_sub(sent_bytes);
        progress.next = next_offset;
        self.delivered.inc_by(deliveries.len() as u64);
        let response = SubscribeResponse {
            start_offset: 0,
            deliveries,
            acked_offset: 0,
        };
        if self.outgoing.send(Ok(response)).await.is_err() {
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
            Some(Kind::Credit(Credit { messages, bytes })) => {
                progress.credit_messages = progress
                    .credit_messages
                    .saturating_add(messages)
                    .min(CREDIT_MESSAGES_MAX);
                progress.credit_bytes = progress
                    .credit_bytes
                    .saturating_add(bytes)
                    .min(CREDIT_BYTES_MAX);
                Ok(())
            }
            Some(Kind::Ack(ack)) => {
                if ack.offset >= progress.next {
                    return Err(invalid(format!(
                        "ack of offset {} is beyond the last delivered offset {}; ack only what \
                         was delivered",
                        ack.offset,
                        progress.next.saturating_sub(1)
                    )));
                }
                if ack.offset >= progress.acked {
                    progress.acked = ack.offset + 1;
                    let queue = &self.start.queue;
                    let name = position_queue(&self.start.consumer, queue);
                    let record = position_record(progress.acked, queue);
                    let (_, ticket) = self
                        .calls
                        .store
                        .append_deferred(&name, &record)
                        .map_err(super::write_error)?;
                    self.calls.durable(Some(ticket)).await?;
                }
                // Durable now (or already before): say so.
                let answer = SubscribeResponse {
                    start_offset: 0,
                    deliveries: Vec::new(),
                    acked_offset: progress.acked,
                };
                let _ = self.outgoing.send(Ok(answer)).await;
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
    credit_messages: u32,
    credit_bytes: u32,
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
                    .append(&name, &position_record(next, b"orders"))
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
