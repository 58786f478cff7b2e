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

use levee_broker::names::{self, POSITION_PREFIX};

use super::{lock, name_error};

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
/// Longest pause between two looks of [`Waiters::wait_out_deletes`].
const DELETE_WAIT_PAUSE_MAX: std::time::Duration = std::time::Duration::from_millis(50);
/// Subscriptions open at once on one server.
pub const SUBSCRIPTIONS_MAX: usize = 100_000;
/// Bytes a consumer's position queue keeps when trimmed: every ack appends one small record,
/// so the queue is trimmed from the front down to this size (its last chunk, which holds the
/// newest position, is far smaller and always stays).
pub const POSITION_QUEUE_BYTES_MAX: u64 = 64 << 10;
/// How often position queues are trimmed.
pub const POSITION_TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Who waits on which queue: appends wake the subscriptions of the queues they grew, single
/// ones ([`Subscribe`], topic members) through a shared [`Notify`], many-queue streams through
/// their [`Inbox`] with the mailbox number.
///
/// [`Subscribe`]: levee_proto::v1::queues_server::Queues::subscribe
#[derive(Debug)]
pub struct Waiters {
    queues: Mutex<WaiterMap>,
}

#[derive(Debug)]
struct WaiterMap {
    entries: HashMap<Box<[u8]>, Watchers, foldhash::fast::RandomState>,
    /// Entries beyond which dead ones are pruned (amortized: twice the live count after each
    /// prune, at least [`SUBSCRIPTIONS_MAX`]).
    prune_at: usize,
    /// Queues being deleted: no subscription may register them until the delete is done.
    deleting: std::collections::HashSet<Box<[u8]>, foldhash::fast::RandomState>,
}

/// The watchers of one queue. A queue is mostly one stream's mailbox: that one is held inline
/// (no allocation, and no second cache miss when an append wakes it).
#[derive(Debug, Default)]
struct Watchers {
    notify: Weak<Notify>,
    inboxes: smallvec::SmallVec<[(Weak<Inbox>, u32); 1]>,
}

impl Watchers {
    fn is_dead(&self) -> bool {
        self.notify.strong_count() == 0 && self.inboxes.is_empty()
    }
}

impl Default for Waiters {
    fn default() -> Self {
        Self {
            queues: Mutex::new(WaiterMap {
                entries: HashMap::default(),
                prune_at: SUBSCRIPTIONS_MAX,
                deleting: std::collections::HashSet::default(),
            }),
        }
    }
}

/// A set of mailbox numbers.
pub type MailboxSet = std::collections::HashSet<u32, foldhash::fast::RandomState>;

/// Most payload bytes of a message an append hands to a stream with its wake-up; a larger one
/// is read from the store.
pub const HINT_PAYLOAD_BYTES_MAX: usize = 4 << 10;
/// Most payload bytes a stream's inbox holds handed over; past it, wake-ups carry no message.
pub const HINT_BYTES_MAX: usize = 256 << 10;
/// Most messages a stream's inbox holds handed over.
pub const HINTS_MAX: usize = 4_096;

/// The message that grew a mailbox's queue, when the wake-up carries it: offset and payload.
type Carried<'a> = Option<(u64, &'a [u8])>;

/// A message an append has just made visible to readers (durable under `always`).
#[derive(Debug, Clone, Copy)]
pub struct Appended<'a> {
    /// Its queue.
    pub queue: &'a [u8],
    /// Its offset.
    pub offset: u64,
    /// Its payload.
    pub payload: &'a [u8],
}

/// Messages handed to a stream with their wake-ups, so that a caught-up mailbox gets them
/// without reading them back from the store: (mailbox, offset, end of the payload in
/// `data`), in the order the appends woke the stream. Bounded by [`HINTS_MAX`] and
/// [`HINT_BYTES_MAX`].
#[derive(Debug, Default)]
pub struct Hints {
    /// Each message's mailbox number, offset and the end of its payload in `data` (it starts
    /// where the previous one ends).
    pub entries: Vec<(u32, u64, usize)>,
    /// The payloads back to back.
    pub data: Vec<u8>,
}

/// What a stream was told since it last looked.
#[derive(Debug, Default)]
pub struct Woken {
    /// Mailboxes whose queues grew (read them from their next offset).
    pub mailboxes: MailboxSet,
    /// Messages handed over.
    pub hints: Hints,
}

impl Woken {
    fn is_empty(&self) -> bool {
        self.mailboxes.is_empty() && self.hints.entries.is_empty()
    }
}

/// A many-queue stream's wake-ups: the mailbox numbers whose queues grew since it last looked,
/// and (bounded) the messages that grew them. Bounded by the stream's mailboxes (a number is
/// held once) and the hint bounds.
#[derive(Debug, Default)]
pub struct Inbox {
    ready: Mutex<Woken>,
    /// Notified (one permit kept) when the inbox stops being empty.
    pub notify: Notify,
}

impl Inbox {
    /// Adds mailboxes to the ready set, or hands their message over when it has one (and the
    /// hint bounds allow); notifies the stream if the inbox was empty.
    fn wake_many<'a>(&self, mailboxes: impl Iterator<Item = (u32, Carried<'a>)>) {
        let mut ready = lock(&self.ready);
        let was_empty = ready.is_empty();
        for (mailbox, message) in mailboxes {
            let hints = &mut ready.hints;
            match message {
                Some((offset, payload))
                    if payload.len() <= HINT_PAYLOAD_BYTES_MAX
                        && hints.entries.len() < HINTS_MAX
                        && hints.data.len() + payload.len() <= HINT_BYTES_MAX =>
                {
                    hints.data.extend_from_slice(payload);
                    hints.entries.push((mailbox, offset, hints.data.len()));
                }
                _ => {
                    ready.mailboxes.insert(mailbox);
                }
            }
        }
        let now_empty = ready.is_empty();
        drop(ready);
        if was_empty && !now_empty {
            self.notify.notify_one();
        }
    }

    /// Takes what was woken since the last call.
    pub fn take(&self) -> Woken {
        std::mem::take(&mut *lock(&self.ready))
    }
}

/// Why a mailbox add registered none of its queues.
#[derive(Debug, PartialEq, Eq)]
pub enum AddRefused {
    /// A queue is already a mailbox of the stream (or named twice).
    Twice {
        /// Its index in the queues added.
        index: usize,
        /// Its mailbox number.
        taken: u32,
    },
    /// A queue is being deleted.
    Deleting {
        /// Its index in the queues added.
        index: usize,
    },
}

/// Why a queue cannot be deleted now.
#[derive(Debug, PartialEq, Eq)]
pub enum DeleteRefused {
    /// A subscription (a single one, or a many-queue stream's mailbox) holds it.
    Subscribed,
    /// Another delete of it is running.
    InProgress,
}

/// Marks a queue as being deleted until dropped (see [`Waiters::begin_delete`]).
#[derive(Debug)]
pub struct Deleting {
    waiters: Arc<Waiters>,
    queue: Box<[u8]>,
}

impl Drop for Deleting {
    fn drop(&mut self) {
        lock(&self.waiters.queues).deleting.remove(&self.queue);
    }
}

fn deleting_error(queue: &[u8]) -> WireError {
    WireError::new(
        ErrorCode::Unavailable,
        format!(
            "queue '{}' is being deleted; subscribe again once the delete has returned",
            String::from_utf8_lossy(queue)
        ),
    )
}

impl Waiters {
    /// Marks `queue` as being deleted, if no subscription holds it: until the returned guard
    /// drops, subscriptions of it are refused, so none can read or ack a position of it
    /// while its consumers' positions are forgotten and the queue deleted.
    pub fn begin_delete(self: &Arc<Self>, queue: &[u8]) -> Result<Deleting, DeleteRefused> {
        let mut map = lock(&self.queues);
        if let Some(watchers) = map.entries.get(queue)
            && (watchers.notify.strong_count() > 0
                || watchers
                    .inboxes
                    .iter()
                    .any(|(inbox, _)| inbox.strong_count() > 0))
        {
            return Err(DeleteRefused::Subscribed);
        }
        if !map.deleting.insert(queue.into()) {
            return Err(DeleteRefused::InProgress);
        }
        Ok(Deleting {
            waiters: Arc::clone(self),
            queue: queue.into(),
        })
    }

    /// The queue's wake-up, shared by its subscriptions; dropped with the last of them.
    /// Refused (`UNAVAILABLE`) while the queue is being deleted.
    pub fn register(&self, queue: &[u8]) -> Result<Arc<Notify>, WireError> {
        let mut map = lock(&self.queues);
        if map.deleting.contains(queue) {
            return Err(deleting_error(queue));
        }
        if let Some(notify) = map.entries.get(queue).and_then(|w| w.notify.upgrade()) {
            return Ok(notify);
        }
        if map.entries.len() >= map.prune_at {
            map.entries.retain(|_, watchers| !watchers.is_dead());
            map.prune_at = (map.entries.len() * 2).max(SUBSCRIPTIONS_MAX);
        }
        let notify = Arc::new(Notify::new());
        map.entries.entry(queue.into()).or_default().notify = Arc::downgrade(&notify);
        Ok(notify)
    }

    /// Waits until none of `queues` is being deleted, checking every millisecond at first and
    /// at most every [`DELETE_WAIT_PAUSE_MAX`] later; after `wait_max`, the index of the first
    /// queue still being deleted. A delete holds its queue for one store write per consumer
    /// with a position log and the store's delete: milliseconds.
    pub async fn wait_out_deletes(
        &self,
        queues: &[Box<[u8]>],
        wait_max: std::time::Duration,
    ) -> Result<(), usize> {
        let started = tokio::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(1);
        loop {
            let deleting = {
                let map = lock(&self.queues);
                if map.deleting.is_empty() {
                    return Ok(());
                }
                queues.iter().position(|queue| map.deleting.contains(queue))
            };
            let Some(index) = deleting else {
                return Ok(());
            };
            if started.elapsed() + pause > wait_max {
                return Err(index);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(DELETE_WAIT_PAUSE_MAX);
        }
    }

    /// Registers `queues` as mailboxes `first..` of `inbox`. If one of them is already a
    /// mailbox of `inbox` (or named twice), or is being deleted, registers none and says
    /// which.
    pub fn add_mailboxes(
        &self,
        inbox: &Arc<Inbox>,
        first: u32,
        queues: &[Box<[u8]>],
    ) -> Result<(), AddRefused> {
        let weak = Arc::downgrade(inbox);
        let mut map = lock(&self.queues);
        if !map.deleting.is_empty()
            && let Some(index) = queues.iter().position(|queue| map.deleting.contains(queue))
        {
            return Err(AddRefused::Deleting { index });
        }
        for ((index, queue), mailbox) in queues.iter().enumerate().zip(first..) {
            let watchers = map.entries.entry(queue.clone()).or_default();
            if let Some(&(_, taken)) = watchers
                .inboxes
                .iter()
                .find(|(other, _)| Weak::ptr_eq(other, &weak))
            {
                let added: Vec<(&[u8], u32)> = queues[..index]
                    .iter()
                    .zip(first..)
                    .map(|(queue, mailbox)| (&queue[..], mailbox))
                    .collect();
                remove_locked(&mut map, &weak, &added);
                return Err(AddRefused::Twice { index, taken });
            }
            watchers.inboxes.push((weak.clone(), mailbox));
        }
        Ok(())
    }

    /// Unregisters mailboxes of `inbox`, each a (queue, mailbox number).
    pub fn remove_mailboxes(&self, inbox: &Arc<Inbox>, mailboxes: &[(&[u8], u32)]) {
        remove_locked(&mut lock(&self.queues), &Arc::downgrade(inbox), mailboxes);
    }

    /// Wakes the subscriptions of `queue`, if any.
    pub fn wake(&self, queue: &[u8]) {
        self.wake_all(&[queue]);
    }

    /// Wakes the subscriptions of every queue in `queues` (a queue named twice is woken once
    /// more, which costs a lookup and nothing else): one lock of the registry for all of them,
    /// and one of each stream's ready set however many of its mailboxes grew.
    pub fn wake_all(&self, queues: &[&[u8]]) {
        self.wake_inner(queues.iter().map(|queue| (*queue, None)), queues.len());
    }

    /// As [`Self::wake_all`] for the queues of `appended`, handing each stream the messages of
    /// its mailboxes (within the hint bounds), in the order given.
    pub fn wake_appended(&self, appended: &[Appended<'_>]) {
        self.wake_inner(
            appended
                .iter()
                .map(|message| (message.queue, Some((message.offset, message.payload)))),
            appended.len(),
        );
    }

    fn wake_inner<'a>(
        &self,
        queues: impl Iterator<Item = (&'a [u8], Carried<'a>)> + Clone,
        count: usize,
    ) {
        type Wake<'w, 'a> = (usize, &'w Weak<Inbox>, u32, Carried<'a>);
        let map = lock(&self.queues);
        if count > 1 {
            // Looked up once first only to bring the entries into the cache: these lookups do
            // not depend on each other, so their misses overlap (at a million mailboxes every
            // one misses).
            let mut touched = 0_usize;
            for (queue, _) in queues.clone() {
                touched ^= map
                    .entries
                    .get(queue)
                    .map_or(0, |watchers| watchers.inboxes.len());
            }
            std::hint::black_box(touched);
        }
        let mut woken: Vec<Wake<'_, 'a>> = Vec::with_capacity(count);
        for (queue, message) in queues {
            let Some(watchers) = map.entries.get(queue) else {
                continue;
            };
            if let Some(notify) = watchers.notify.upgrade() {
                notify.notify_waiters();
            }
            woken.extend(
                watchers
                    .inboxes
                    .iter()
                    .map(|(inbox, mailbox)| (inbox.as_ptr() as usize, inbox, *mailbox, message)),
            );
        }
        // Grouped by stream, keeping the order within each (a stable sort): a mailbox's
        // messages are handed over in offset order.
        woken.sort_by_key(|(inbox, ..)| *inbox);
        // The streams are taken under the registry's lock and their inboxes filled after it is
        // released: copying the handed-over payloads holds up no other wake-up, add or remove.
        let mut streams: Vec<(Arc<Inbox>, std::ops::Range<usize>)> = Vec::new();
        let mut start = 0;
        for group in woken.chunk_by(|a, b| a.0 == b.0) {
            let range = start..start + group.len();
            start = range.end;
            if let Some(inbox) = group[0].1.upgrade() {
                streams.push((inbox, range));
            }
        }
        let items: Vec<(u32, Carried<'_>)> = woken
            .iter()
            .map(|(_, _, mailbox, message)| (*mailbox, *message))
            .collect();
        drop(woken);
        drop(map);
        for (inbox, range) in streams {
            inbox.wake_many(items[range].iter().copied());
        }
    }

    /// Queues registered now (live or not yet pruned).
    pub fn len(&self) -> usize {
        lock(&self.queues).entries.len()
    }

    /// Whether no queue is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn remove_locked(map: &mut WaiterMap, inbox: &Weak<Inbox>, mailboxes: &[(&[u8], u32)]) {
    for &(queue, mailbox) in mailboxes {
        let Some(watchers) = map.entries.get_mut(queue) else {
            continue;
        };
        watchers
            .inboxes
            .retain(|(other, number)| !(Weak::ptr_eq(other, inbox) && *number == mailbox));
        if watchers.is_dead() {
            map.entries.remove(queue);
        }
    }
}

fn invalid(message: String) -> WireError {
    WireError::new(ErrorCode::InvalidArgument, message)
}

/// The name of the queue holding `consumer`'s acked positions on `queue`.
pub(crate) fn position_queue(consumer: &str, queue: &[u8]) -> Vec<u8> {
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
    let report = store.enforce_retention(now_ms, |name| {
        if names::LOG_QUEUE_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
        {
            levee_store::Retention {
                max_age_ms: None,
                max_bytes: Some(POSITION_QUEUE_BYTES_MAX),
            }
        } else if names::is_reserved(name) {
            levee_store::Retention::default()
        } else {
            rule(name)
        }
    })?;
    Ok(report.messages_removed)
}

/// A position record: the next offset to deliver, then the queue's name (to detect a hash
/// collision).
pub(crate) fn position_record(next: u64, queue: &[u8]) -> Vec<u8> {
    let mut record = next.to_le_bytes().to_vec();
    record.extend_from_slice(queue);
    record
}

/// The consumer's next offset on `queue`: after its last ack, or 0. Blocks on the store (it
/// may wait for a commit round, see [`super::last_record`]): call it on the blocking pool.
pub(crate) fn load_position(store: &Store, consumer: &str, queue: &[u8]) -> Result<u64, WireError> {
    let Some(record) = super::last_record(store, &position_queue(consumer, queue))? else {
        return Ok(0);
    };
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

/// Checks a stream's initial credit: 1 to [`CREDIT_MESSAGES_MAX`] messages.
pub(crate) fn check_credit(credit: Option<&Credit>) -> Result<(), WireError> {
    let messages = credit.map_or(0, |credit| credit.messages);
    if !(1..=CREDIT_MESSAGES_MAX).contains(&messages) {
        return Err(invalid(format!(
            "credit.messages must be 1 to {CREDIT_MESSAGES_MAX}, got {messages}"
        )));
    }
    Ok(())
}

/// What a stream's client still lets the server send: messages and payload bytes.
#[derive(Debug, Clone, Copy)]
pub struct StreamCredit {
    /// Messages.
    pub messages: u32,
    /// Payload bytes.
    pub bytes: u32,
}

impl StreamCredit {
    /// The credit of a checked start: bytes 0 means [`CREDIT_BYTES_DEFAULT`]; capped at
    /// [`CREDIT_MESSAGES_MAX`] and [`CREDIT_BYTES_MAX`].
    pub fn initial(credit: Option<Credit>) -> Self {
        let credit = credit.unwrap_or_default();
        let bytes = if credit.bytes == 0 {
            CREDIT_BYTES_DEFAULT
        } else {
            credit.bytes
        };
        Self {
            messages: credit.messages.min(CREDIT_MESSAGES_MAX),
            bytes: bytes.min(CREDIT_BYTES_MAX),
        }
    }

    /// Adds the client's grant, within the caps.
    pub fn grant(&mut self, credit: Credit) {
        self.messages = self
            .messages
            .saturating_add(credit.messages)
            .min(CREDIT_MESSAGES_MAX);
        self.bytes = self
            .bytes
            .saturating_add(credit.bytes)
            .min(CREDIT_BYTES_MAX);
    }

    /// Takes what was sent (a message may pass the byte credit alone: it ends at 0).
    pub fn spend(&mut self, messages: usize, bytes: usize) {
        self.messages = self
            .messages
            .saturating_sub(u32::try_from(messages).unwrap_or(u32::MAX));
        self.bytes = self
            .bytes
            .saturating_sub(u32::try_from(bytes).unwrap_or(u32::MAX));
    }

    /// Whether anything may be sent.
    pub fn is_open(&self) -> bool {
        self.messages > 0 && self.bytes > 0
    }
}

/// One subscription's state.
#[derive(Debug)]
pub struct Session {
    /// Store calls (reads inline, acks' durability awaited without a thread).
    pub calls: super::StoreCalls,
    /// Wakes this session when its queue grows.
    pub notify: Arc<Notify>,
    /// Consumers' position logs (`SubscribeMany` acks), read with the position queue.
    pub positions: Arc<super::position_log::PositionLogs>,
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
        let next = {
            // The larger of this queue's position queue and the consumer's position log, so a
            // consumer may move a queue between single and many-queue streams.
            let log = self.positions.open(&consumer);
            let queues = [queue.clone().into_boxed_slice()];
            self.calls
                .run(move |_| Ok(log.positions(&queues)?[0].next))
                .await?
        };
        let mut progress = Progress {
            next,
            acked: next,
            credit: StreamCredit::initial(self.start.credit),
            writer_noted: false,
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
        if !progress.credit.is_open() {
            return Ok(Delivered::Nothing);
        }
        let (queue, from) = (&self.start.queue, progress.next);
        let count = progress.credit.messages.min(READ_MESSAGES_MAX) as usize;
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
        let deliveries: Vec<Delivery> = super::payloads(batch)
            .zip(first_offset..)
            .map(|(payload, offset)| Delivery { offset, payload })
            .collect();
        progress.credit.spend(deliveries.len(), sent_bytes);
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
            Some(Kind::Credit(credit)) => {
                progress.credit.grant(credit);
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
                    if !progress.writer_noted {
                        self.positions.note_writer(&self.start.consumer);
                        progress.writer_noted = true;
                    }
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
    credit: StreamCredit,
    /// Whether the consumer was noted as a writer of positions (before its first ack).
    writer_noted: bool,
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

    fn names(names: &[&str]) -> Vec<Box<[u8]>> {
        names.iter().map(|name| name.as_bytes().into()).collect()
    }

    #[test]
    fn given_a_queue_held_or_being_deleted_then_deletes_and_subscriptions_exclude_each_other() {
        let waiters = Arc::new(Waiters::default());
        let inbox = Arc::new(Inbox::default());
        waiters.add_mailboxes(&inbox, 0, &names(&["a"])).unwrap();
        let single = waiters.register(b"a").unwrap();
        assert_eq!(
            waiters.begin_delete(b"a").unwrap_err(),
            DeleteRefused::Subscribed
        );
        drop(single);
        assert_eq!(
            waiters.begin_delete(b"a").unwrap_err(),
            DeleteRefused::Subscribed
        );
        waiters.remove_mailboxes(&inbox, &[(b"a", 0)]);
        let deleting = waiters.begin_delete(b"a").unwrap();
        assert_eq!(
            waiters.begin_delete(b"a").unwrap_err(),
            DeleteRefused::InProgress
        );
        let error = waiters.register(b"a").unwrap_err();
        assert_eq!(error.code, ErrorCode::Unavailable);
        assert!(error.message.contains("being deleted"), "{}", error.message);
        assert_eq!(
            waiters.add_mailboxes(&inbox, 1, &names(&["b", "a"])),
            Err(AddRefused::Deleting { index: 1 })
        );
        waiters.wake(b"b");
        assert!(inbox.take().mailboxes.is_empty(), "'b' was not registered");
        // A stream that ended (its inbox dropped) does not hold the queue.
        let gone = Arc::new(Inbox::default());
        waiters.add_mailboxes(&gone, 0, &names(&["c"])).unwrap();
        drop(gone);
        drop(waiters.begin_delete(b"c").unwrap());
        drop(deleting);
        waiters.register(b"a").unwrap();
        waiters.add_mailboxes(&inbox, 1, &names(&["b"])).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn given_a_queue_being_deleted_then_an_add_waits_for_the_delete_within_its_bound() {
        let waiters = Arc::new(Waiters::default());
        let wait_max = std::time::Duration::from_secs(5);
        // Nothing being deleted, or only another queue: no wait.
        let started = tokio::time::Instant::now();
        for another_deleted in [false, true] {
            let _other = another_deleted.then(|| waiters.begin_delete(b"z").unwrap());
            waiters
                .wait_out_deletes(&names(&["a", "b"]), wait_max)
                .await
                .unwrap();
            assert_eq!(started.elapsed(), std::time::Duration::ZERO);
        }
        // A delete of one of them that returns after 300 ms: the add goes on then, not later
        // than one pause after.
        let deleting = waiters.begin_delete(b"b").unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            drop(deleting);
        });
        waiters
            .wait_out_deletes(&names(&["a", "b"]), wait_max)
            .await
            .unwrap();
        let waited = started.elapsed();
        assert!(
            waited >= std::time::Duration::from_millis(300)
                && waited <= std::time::Duration::from_millis(300) + DELETE_WAIT_PAUSE_MAX,
            "{waited:?}"
        );
        release.await.unwrap();
        let inbox = Arc::new(Inbox::default());
        waiters
            .add_mailboxes(&inbox, 0, &names(&["a", "b"]))
            .unwrap();
        // A delete that outlasts the bound: the index of its queue, after the bound.
        let stuck = waiters.begin_delete(b"c").unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            waiters
                .wait_out_deletes(&names(&["d", "c"]), wait_max)
                .await,
            Err(1)
        );
        let waited = started.elapsed();
        assert!(
            waited <= wait_max && waited + DELETE_WAIT_PAUSE_MAX >= wait_max,
            "{waited:?}"
        );
        drop(stuck);
    }

    #[test]
    fn given_mailboxes_then_wakes_reach_their_inbox_once_and_removal_forgets_them() {
        let waiters = Waiters::default();
        let (one, two) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
        waiters.add_mailboxes(&one, 0, &names(&["a", "b"])).unwrap();
        waiters.add_mailboxes(&two, 5, &names(&["b"])).unwrap();
        let _single = waiters.register(b"b").unwrap();
        // A queue twice on one inbox (here within one add) registers nothing of that add.
        assert_eq!(
            waiters.add_mailboxes(&one, 2, &names(&["c", "a"])),
            Err(AddRefused::Twice { index: 1, taken: 0 })
        );
        assert_eq!(waiters.len(), 2, "'c' was rolled back");
        for _ in 0..3 {
            waiters.wake(b"b");
        }
        waiters.wake(b"a");
        waiters.wake(b"unknown");
        let mut woken: Vec<u32> = one.take().mailboxes.into_iter().collect();
        woken.sort_unstable();
        assert_eq!(woken, vec![0, 1]);
        assert_eq!(
            two.take().mailboxes.into_iter().collect::<Vec<_>>(),
            vec![5]
        );
        assert!(one.take().mailboxes.is_empty());
        waiters.remove_mailboxes(&one, &[(b"a", 0), (b"b", 1)]);
        assert_eq!(waiters.len(), 1, "'b' is still watched");
        waiters.wake(b"b");
        assert!(one.take().mailboxes.is_empty());
        assert_eq!(two.take().mailboxes.len(), 1);
    }

    #[test]
    fn given_appended_messages_then_the_inbox_holds_them_in_order_within_its_bounds() {
        let waiters = Waiters::default();
        let inbox = Arc::new(Inbox::default());
        waiters
            .add_mailboxes(&inbox, 3, &names(&["a", "b"]))
            .unwrap();
        let large = vec![7_u8; HINT_PAYLOAD_BYTES_MAX + 1];
        let appended = |queue: &'static str, offset: u64, payload: &'static [u8]| Appended {
            queue: queue.as_bytes(),
            offset,
            payload,
        };
        waiters.wake_appended(&[
            appended("b", 0, b"b0"),
            appended("a", 0, b"a0"),
            appended("unknown", 0, b"?"),
            appended("b", 1, b"b1"),
        ]);
        waiters.wake_appended(&[Appended {
            queue: b"a",
            offset: 1,
            payload: &large,
        }]);
        let woken = inbox.take();
        let hints = &woken.hints;
        let offsets: Vec<(u32, u64)> = hints.entries.iter().map(|&(m, o, _)| (m, o)).collect();
        assert_eq!(
            offsets,
            vec![(4, 0), (3, 0), (4, 1)],
            "in the order appended"
        );
        let ends: Vec<usize> = hints.entries.iter().map(|&(.., end)| end).collect();
        assert_eq!((ends, &hints.data[..]), (vec![2, 4, 6], &b"b0a0b1"[..]));
        // Too large to hand over: a plain wake-up, read from the store.
        assert_eq!(woken.mailboxes.into_iter().collect::<Vec<_>>(), vec![3]);

        // Past the byte bound, wake-ups carry no message; the inbox never holds more.
        let payload = vec![1_u8; HINT_PAYLOAD_BYTES_MAX];
        let many: Vec<Appended<'_>> = (0..HINT_BYTES_MAX / HINT_PAYLOAD_BYTES_MAX + 2)
            .map(|offset| Appended {
                queue: b"a",
                offset: offset as u64,
                payload: &payload,
            })
            .collect();
        waiters.wake_appended(&many);
        let woken = inbox.take();
        assert_eq!(woken.hints.data.len(), HINT_BYTES_MAX);
        assert_eq!(
            woken.hints.entries.len(),
            HINT_BYTES_MAX / HINT_PAYLOAD_BYTES_MAX
        );
        assert_eq!(woken.mailboxes.into_iter().collect::<Vec<_>>(), vec![3]);
        // And past the count bound.
        let tiny: Vec<Appended<'_>> = (0..HINTS_MAX + 5)
            .map(|offset| Appended {
                queue: b"b",
                offset: offset as u64,
                payload: b"t",
            })
            .collect();
        waiters.wake_appended(&tiny);
        let woken = inbox.take();
        assert_eq!(woken.hints.entries.len(), HINTS_MAX);
        assert_eq!(woken.mailboxes.into_iter().collect::<Vec<_>>(), vec![4]);
        assert!(inbox.take().is_empty());
    }

    #[test]
    fn given_one_wake_for_many_queues_then_each_inbox_gets_its_mailboxes_and_one_permit() {
        let waiters = Waiters::default();
        let (one, two) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
        waiters
            .add_mailboxes(&one, 0, &names(&["a", "b", "c"]))
            .unwrap();
        waiters.add_mailboxes(&two, 7, &names(&["b", "d"])).unwrap();
        let single = waiters.register(b"d").unwrap();
        // Interleaved inboxes, a name twice, an unknown name.
        waiters.wake_all(&[b"d", b"a", b"b", b"unknown", b"a", b"c"]);
        let sorted = |inbox: &Inbox| {
            let mut woken: Vec<u32> = inbox.take().mailboxes.into_iter().collect();
            woken.sort_unstable();
            woken
        };
        // Whether a wait on `notify` would end at once (a permit is stored, or it was woken).
        let ready = |notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>| {
            let mut context = std::task::Context::from_waker(std::task::Waker::noop());
            std::future::Future::poll(notified, &mut context).is_ready()
        };
        for inbox in [&one, &two] {
            assert!(ready(std::pin::pin!(inbox.notify.notified())));
            assert!(
                !ready(std::pin::pin!(inbox.notify.notified())),
                "one permit, not one per mailbox"
            );
        }
        assert_eq!(sorted(&one), vec![0, 1, 2]);
        assert_eq!(sorted(&two), vec![7, 8]);
        // The single subscription of "d" is woken too (`notify_waiters` wakes those waiting).
        let mut notified = std::pin::pin!(single.notified());
        notified.as_mut().enable();
        waiters.wake_all(&[b"d"]);
        assert!(ready(notified));
        assert_eq!(sorted(&two), vec![8]);
        assert!(sorted(&one).is_empty());
        // Nothing woken: no set grows.
        waiters.wake_all(&[]);
        assert!(sorted(&one).is_empty() && sorted(&two).is_empty());
    }

    #[test]
    fn given_an_ack_not_yet_fsynced_under_always_then_loading_the_position_waits_for_it() {
        let directory = tempfile::tempdir().unwrap();
        let options = levee_store::StoreOptions {
            sync: levee_store::SyncPolicy::Always,
            ..levee_store::StoreOptions::default()
        };
        let (store, _) = Store::open(directory.path(), options).unwrap();
        let name = position_queue("app", b"orders");
        store.append(&name, &position_record(3, b"orders")).unwrap();
        // The next ack is buffered and nobody waits for its round: under `always` a reader
        // does not see it yet, but its queue's next offset already counts it.
        store
            .append_deferred(&name, &position_record(7, b"orders"))
            .unwrap();
        assert_eq!(load_position(&store, "app", b"orders").unwrap(), 7);
        assert_eq!(load_position(&store, "other", b"orders").unwrap(), 0);
        // A record of another queue (a hash collision) is still refused.
        store
            .append(&name, &position_record(9, b"not orders"))
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
