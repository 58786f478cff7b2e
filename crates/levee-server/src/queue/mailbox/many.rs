//! Many-queue subscriptions (`SubscribeMany`): one consumer's stream over up to
//! [`MAILBOXES_PER_STREAM_MAX`] queues, the way an app server holds the mailboxes of its
//! connected users. Each queue added is a mailbox with a number (the order of adds); delivery,
//! positions and acks behave as those of a single subscription ([`crate::queue::subscription`]):
//! delivery starts after the consumer's last ack on the queue and acks are cumulative, written
//! through the store's log. One credit covers the stream.
//!
//! Wake-ups cost nothing per idle mailbox: an append puts the mailbox's number in the stream's
//! [`Inbox`] (a set, so bounded by the stream's mailboxes) and the session reads only the
//! mailboxes it was told about, round-robin, until each is caught up. A delivery response
//! carries messages of many mailboxes.
//!
//! Positions go to the consumer's position log ([`crate::queue::position_log`]): an ack batch is a
//! few records appended to one queue, not a record per mailbox's position queue.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use levee_proto::WireError;
use levee_proto::v1::subscribe_many_request::Kind;
use levee_proto::v1::{
    AddMailboxes, ErrorCode, MailboxAcks, MailboxDelivery, RemoveMailboxes, SubscribeManyRequest,
    SubscribeManyResponse, SubscribeManyStart,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{Semaphore, oneshot, watch};

use crate::queue::StoreCalls;
use crate::queue::credit::{ROUND_BYTES_MAX, ROUND_MESSAGES_MAX, StreamCredit};
use crate::queue::invalid;
use crate::queue::mailbox::position_log::{ConsumerLog, Position, PositionLogs};
use crate::queue::mailbox::subscription::{check_consumer_and_credit, check_queue_name};
use crate::queue::stream::{Incoming, Outgoing};
use crate::queue::waiters::{AddRefused, Hints, Inbox, Waiters};

/// Most mailboxes on one stream.
pub const MAILBOXES_PER_STREAM_MAX: u32 = 1_000_000;
/// Most mailboxes over all streams of one server (each costs about 200 bytes of memory).
pub const MAILBOXES_MAX: i64 = 4_000_000;
/// Most queues one `AddMailboxes` (or mailboxes one `RemoveMailboxes`) names.
pub const ADD_MAX: usize = 10_000;
/// Longest an add waits for deletes of its queues to return before the stream ends (the
/// stream delivers nothing meanwhile; a delete takes milliseconds).
pub const ADD_DELETE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(5);
/// Most acks in one `MailboxAcks`.
pub const ACKS_MAX: usize = 10_000;
/// Ack batches whose durability one stream awaits at once; further acks wait (back-pressure).
const ACK_WAITS_MAX: usize = 16;

/// The error that ends a stream whose add waited [`ADD_DELETE_WAIT_MAX`] for a delete.
fn still_deleting(index: usize, queues: &[Box<[u8]>]) -> WireError {
    WireError::new(
        ErrorCode::Unavailable,
        format!(
            "queues[{index}] ('{}') is still being deleted after {} s, so this stream ends; \
             open it again and add the queue once the delete has returned",
            String::from_utf8_lossy(&queues[index]),
            ADD_DELETE_WAIT_MAX.as_secs()
        ),
    )
}

/// Checks the start message: consumer name and credit.
pub fn check_start(start: &SubscribeManyStart) -> Result<(), WireError> {
    check_consumer_and_credit(&start.consumer, start.credit.as_ref())
}

/// Checks an add of `queues` to a stream holding `live` mailboxes whose next number is
/// `next`: 1 to [`ADD_MAX`] valid names, within [`MAILBOXES_PER_STREAM_MAX`] and the numbers
/// left. Returns how many.
pub(crate) fn check_add(queues: &[Vec<u8>], live: u32, next: u32) -> Result<u32, WireError> {
    if queues.is_empty() || queues.len() > ADD_MAX {
        return Err(invalid(format!(
            "an add names 1 to {ADD_MAX} queues, got {}",
            queues.len()
        )));
    }
    for (index, queue) in queues.iter().enumerate() {
        check_queue_name(queue)
            .map_err(|error| invalid(format!("queues[{index}]: {}", error.message)))?;
    }
    let count = u32::try_from(queues.len()).unwrap_or(u32::MAX);
    if live + count > MAILBOXES_PER_STREAM_MAX {
        return Err(WireError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "a stream holds at most {MAILBOXES_PER_STREAM_MAX} mailboxes ({live} now, \
                 {count} more asked); open another stream"
            ),
        ));
    }
    if next.checked_add(count).is_none() {
        return Err(WireError::new(
            ErrorCode::ResourceExhausted,
            "this stream has used up its mailbox numbers; open another stream",
        ));
    }
    Ok(count)
}

/// One mailbox of a stream.
#[derive(Debug)]
struct Mailbox {
    queue: Box<[u8]>,
    /// The next offset to deliver.
    next: u64,
    /// The offset after the last acked one.
    acked: u64,
    /// The epoch its acks are written in (see [`crate::queue::mailbox::position_log::Position`]), and in the
    /// top bit whether it is in the session's to-do list (woken and not yet caught up): one
    /// word, so a mailbox stays 40 bytes (a million of them are looked up at random).
    epoch_and_scheduled: u64,
}

impl Mailbox {
    const SCHEDULED: u64 = 1 << 63;

    fn new(queue: Box<[u8]>, Position { epoch, next }: Position) -> Self {
        debug_assert!(epoch < Self::SCHEDULED, "an epoch counts deletes");
        Self {
            queue,
            next,
            acked: next,
            // An epoch counts deletes: it never reaches the top bit.
            epoch_and_scheduled: (epoch & !Self::SCHEDULED) | Self::SCHEDULED,
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch_and_scheduled & !Self::SCHEDULED
    }

    fn scheduled(&self) -> bool {
        self.epoch_and_scheduled & Self::SCHEDULED != 0
    }

    fn set_scheduled(&mut self, scheduled: bool) {
        if scheduled {
            self.epoch_and_scheduled |= Self::SCHEDULED;
        } else {
            self.epoch_and_scheduled &= !Self::SCHEDULED;
        }
    }
}

/// What the server shares with every many-queue stream.
#[derive(Debug, Clone)]
pub struct ManyContext {
    /// Store calls.
    pub calls: StoreCalls,
    /// Wake-ups by queue.
    pub waiters: Arc<Waiters>,
    /// Consumers' position logs.
    pub positions: Arc<PositionLogs>,
    /// The cluster's shards, through which acks go when it replicates its queues.
    pub replication: Option<crate::queue::replicated::Replication>,
    /// Messages pushed to subscriptions.
    pub delivered: Counter,
    /// Of those, messages handed over by their append (not read back from the store).
    pub handed_over: Counter,
    /// Mailboxes over all streams (also the server-wide bound's count).
    pub mailboxes: Gauge,
    /// Turns true when the server shuts down.
    pub closing: watch::Receiver<bool>,
}

/// One `SubscribeMany` stream's state.
#[derive(Debug)]
pub struct ManySession {
    context: ManyContext,
    log: Arc<ConsumerLog>,
    inbox: Arc<Inbox>,
    incoming: Incoming<SubscribeManyRequest>,
    outgoing: Outgoing<SubscribeManyResponse>,
    mailboxes: HashMap<u32, Mailbox, foldhash::fast::RandomState>,
    /// The number the next added queue gets.
    next_number: u32,
    /// Mailboxes with messages to deliver, in turn.
    todo: VecDeque<u32>,
    credit: StreamCredit,
    ack_waits: Arc<Semaphore>,
    /// In a cluster that replicates its queues: done when the last ack batch was answered
    /// (batches are answered in order though written at once).
    last_ack: Option<oneshot::Receiver<()>>,
    /// Replicated deletes this stream has looked at (see `Waiters::deleted_since`): one of a
    /// queue it holds ends it.
    deletes_seen: u64,
    /// Shard moves off this node this stream has looked at (see `Waiters::shards_moved`): a
    /// move of the shard of a queue it holds ends it. Taken before the first add, which
    /// checks that its queues' shards are held here.
    moves_seen: u64,
}

/// What the session waited for.
enum Event {
    Message(Option<SubscribeManyRequest>),
    Work,
    Closing,
}

impl ManySession {
    /// A session for a checked `start`.
    pub fn new(
        context: ManyContext,
        start: &SubscribeManyStart,
        incoming: Incoming<SubscribeManyRequest>,
        outgoing: Outgoing<SubscribeManyResponse>,
    ) -> Self {
        let log = context.positions.open(&start.consumer);
        let deletes_seen = context.waiters.deletes_seen();
        let moves_seen = context.waiters.shards_moved();
        Self {
            deletes_seen,
            moves_seen,
            context,
            log,
            inbox: Arc::new(Inbox::default()),
            incoming,
            outgoing,
            mailboxes: HashMap::default(),
            next_number: 0,
            todo: VecDeque::new(),
            credit: StreamCredit::initial(start.credit),
            ack_waits: Arc::new(Semaphore::new(ACK_WAITS_MAX)),
            last_ack: None,
        }
    }

    /// Runs the stream until the client leaves or breaks the protocol, then unregisters its
    /// mailboxes.
    pub async fn run(mut self) {
        let result = self.serve().await;
        let numbers: Vec<u32> = self.mailboxes.keys().copied().collect();
        for chunk in numbers.chunks(ADD_MAX) {
            self.remove(chunk);
        }
        if let Err(error) = result {
            self.outgoing.fail(error).await;
        }
    }

    async fn serve(&mut self) -> Result<(), WireError> {
        let mut closing = self.context.closing.clone();
        loop {
            let hints = self.take_woken();
            if !self.deliver(hints).await? {
                return Ok(());
            }
            let busy = self.credit.is_open() && !self.todo.is_empty();
            let inbox = Arc::clone(&self.inbox);
            // Client messages first, so acks and credits are not starved by a long backlog.
            let event = tokio::select! {
                biased;
                // A transport error (a message over the size limit) ends the stream with it.
                message = self.incoming.message() => Event::Message(message?),
                _ = closing.wait_for(|closing| *closing) => Event::Closing,
                () = inbox.notify.notified(), if !busy => Event::Work,
                () = std::future::ready(()), if busy => Event::Work,
            };
            match event {
                Event::Message(Some(message)) => self.handle(message).await?,
                Event::Message(None) => return Ok(()),
                Event::Work => {}
                Event::Closing => {
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        "server shutting down; subscribe again, to this server once it is back \
                         or to another",
                    ));
                }
            }
        }
    }

    /// Moves the mailboxes woken since the last look to the to-do list; returns the messages
    /// handed over with the wake-ups.
    fn take_woken(&mut self) -> Hints {
        let woken = self.inbox.take();
        for number in woken.mailboxes {
            if let Some(mailbox) = self.mailboxes.get_mut(&number)
                && !mailbox.scheduled()
            {
                mailbox.set_scheduled(true);
                self.todo.push_back(number);
            }
        }
        woken.hints
    }

    /// Delivers the handed-over messages that are their mailbox's next one, within the credit
    /// and the round's bounds; a mailbox whose message cannot go now, or that is behind (an
    /// earlier message was not handed over, or comes later), is put on the to-do list to be
    /// read from the store. A message already delivered by a read is dropped.
    fn deliver_hinted(
        &mut self,
        hints: Hints,
        deliveries: &mut Vec<MailboxDelivery>,
        bytes: &mut u32,
    ) {
        let data = levee_proto::Bytes::from(hints.data);
        let mut start = 0;
        for (number, offset, end) in hints.entries {
            let payload = start..end;
            start = end;
            let Some(mailbox) = self.mailboxes.get_mut(&number) else {
                continue;
            };
            if offset < mailbox.next {
                continue;
            }
            let room = self.credit.is_open()
                && deliveries.len() < ROUND_MESSAGES_MAX as usize
                && *bytes < ROUND_BYTES_MAX;
            if offset == mailbox.next && room {
                let len = payload.len();
                deliveries.push(MailboxDelivery {
                    mailbox: number,
                    offset,
                    payload: data.slice(payload),
                });
                self.credit.spend(1, len);
                *bytes = bytes.saturating_add(u32::try_from(len).unwrap_or(u32::MAX));
                mailbox.next = offset + 1;
                self.context.handed_over.inc();
            } else if !mailbox.scheduled() {
                mailbox.set_scheduled(true);
                self.todo.push_back(number);
            }
        }
    }

    /// One delivery round within the credit: first the messages handed over with the
    /// wake-ups, then the mailboxes in turn, each read from its next offset (inline: the
    /// store's index and page cache); a mailbox not caught up goes to the back of the list.
    /// Returns false if the client is gone.
    async fn deliver(&mut self, hints: Hints) -> Result<bool, WireError> {
        if self.context.waiters.deletes_seen() != self.deletes_seen {
            self.check_not_deleted()?;
        }
        if self.context.waiters.shards_moved() != self.moves_seen
            && let Some(groups) = self.replicated()?
        {
            self.moves_seen = crate::queue::replicated::Replication::check_still_held(
                &groups,
                &self.context.waiters,
                self.moves_seen,
                self.mailboxes.values().map(|mailbox| &mailbox.queue[..]),
            )?;
        }
        let mut deliveries = Vec::with_capacity(hints.entries.len());
        let mut bytes = 0_u32;
        self.deliver_hinted(hints, &mut deliveries, &mut bytes);
        let mut turns = self.todo.len();
        while self.credit.is_open() && turns > 0 {
            turns -= 1;
            let sent = u32::try_from(deliveries.len()).unwrap_or(u32::MAX);
            if sent >= ROUND_MESSAGES_MAX || bytes >= ROUND_BYTES_MAX {
                break;
            }
            let Some(number) = self.todo.pop_front() else {
                break;
            };
            let Some(mailbox) = self.mailboxes.get_mut(&number) else {
                continue;
            };
            let count = self.credit.messages.min(ROUND_MESSAGES_MAX - sent);
            let byte_room = self.credit.bytes.min(ROUND_BYTES_MAX - bytes);
            let batch = self
                .context
                .calls
                .store
                .read(
                    &mailbox.queue,
                    mailbox.next,
                    count as usize,
                    byte_room as usize,
                )
                .map_err(|error| crate::queue::storage_error(&error))?;
            if batch.skipped_to_first_retained {
                mailbox.next = batch.first_offset;
            }
            if batch.is_empty() {
                mailbox.set_scheduled(false);
                continue;
            }
            let read_bytes = u32::try_from(batch.bytes()).unwrap_or(u32::MAX);
            let (first_offset, next_offset) = (batch.first_offset, batch.next_offset());
            let caught_up = next_offset >= batch.visible_end_offset;
            deliveries.extend(crate::queue::payloads(batch).zip(first_offset..).map(
                |(payload, offset)| MailboxDelivery {
                    mailbox: number,
                    offset,
                    payload,
                },
            ));
            let read = usize::try_from(next_offset - first_offset).unwrap_or(usize::MAX);
            self.credit.spend(read, read_bytes as usize);
            bytes = bytes.saturating_add(read_bytes);
            mailbox.next = next_offset;
            if caught_up {
                mailbox.set_scheduled(false);
            } else {
                self.todo.push_back(number);
            }
        }
        if deliveries.is_empty() {
            return Ok(true);
        }
        self.context.delivered.inc_by(deliveries.len() as u64);
        let response = SubscribeManyResponse {
            deliveries,
            ..SubscribeManyResponse::default()
        };
        Ok(self.outgoing.send(response).await)
    }

    /// Applies one client message.
    async fn handle(&mut self, message: SubscribeManyRequest) -> Result<(), WireError> {
        match message.kind {
            Some(Kind::Add(add)) => self.add(add).await,
            Some(Kind::Remove(RemoveMailboxes { mailboxes })) => {
                if mailboxes.len() > ADD_MAX {
                    return Err(invalid(format!(
                        "a remove names at most {ADD_MAX} mailboxes, got {}",
                        mailboxes.len()
                    )));
                }
                self.remove(&mailboxes);
                Ok(())
            }
            Some(Kind::Credit(credit)) => {
                self.credit.grant(credit);
                Ok(())
            }
            Some(Kind::Ack(acks)) => self.ack(acks).await,
            Some(Kind::Start(_)) | None => Err(invalid(
                "a SubscribeMany stream takes one start message".to_owned(),
            )),
        }
    }

    /// Adds queues as the next mailboxes: checks them, reserves room, loads the consumer's
    /// positions (on the blocking pool), registers the wake-ups, then schedules a first read
    /// of each (so messages appended before the registration are found).
    async fn add(&mut self, AddMailboxes { queues }: AddMailboxes) -> Result<(), WireError> {
        let live = u32::try_from(self.mailboxes.len()).unwrap_or(u32::MAX);
        let count = check_add(&queues, live, self.next_number)?;
        let first = self.next_number;
        // Deletes so far are of queues held before (checked now), not of those added next,
        // whose positions are read after them.
        self.check_not_deleted()?;
        let reserved = Reservation::take(&self.context.mailboxes, count)?;
        let mut queues: Vec<Box<[u8]>> = queues.into_iter().map(Vec::into_boxed_slice).collect();
        if let Some(groups) = self.replicated()? {
            // Every ack confirmed anywhere before is applied here before positions are read.
            crate::queue::replicated::Replication::barrier(&groups, &queues).await?;
        }
        // A queue being deleted is added once its delete has returned (its position then
        // forgotten): the add waits for it, up to ADD_DELETE_WAIT_MAX in all.
        let waiting_since = tokio::time::Instant::now();
        let (deletes, mut queues, mut positions) = loop {
            let wait_left = ADD_DELETE_WAIT_MAX.saturating_sub(waiting_since.elapsed());
            if let Err(index) = self
                .context
                .waiters
                .wait_out_deletes(&queues, wait_left)
                .await
            {
                return Err(still_deleting(index, &queues));
            }
            let deletes = self.context.positions.deletes();
            let (read, positions) = self.positions(queues).await?;
            queues = read;
            match self
                .context
                .waiters
                .add_mailboxes(&self.inbox, first, &queues)
            {
                Ok(()) => break (deletes, queues, positions),
                Err(AddRefused::Twice { index, taken }) => {
                    return Err(invalid(format!(
                        "queues[{index}] ('{}') is already mailbox {taken} on this stream; add \
                         a queue once",
                        String::from_utf8_lossy(&queues[index])
                    )));
                }
                // A delete began after the wait: wait for it too, within the same bound.
                Err(AddRefused::Deleting { index }) => {
                    if waiting_since.elapsed() >= ADD_DELETE_WAIT_MAX {
                        return Err(still_deleting(index, &queues));
                    }
                }
            }
        };
        // A delete that completed between the read and the registration may have forgotten
        // a position just read: read them again, once (registered now, the queues cannot be
        // deleted any more: a delete completing later is of other queues).
        if self.context.positions.deletes() != deletes {
            (queues, positions) = self.positions(queues).await?;
        }
        reserved.keep();
        for ((queue, position), number) in queues.into_iter().zip(positions).zip(first..) {
            self.mailboxes.insert(number, Mailbox::new(queue, position));
            self.todo.push_back(number);
        }
        self.next_number = first + count;
        let answer = SubscribeManyResponse {
            mailboxes_added: self.next_number,
            ..SubscribeManyResponse::default()
        };
        let _ = self.outgoing.send(answer).await;
        Ok(())
    }

    /// The consumer's positions on `queues`, read on the blocking pool.
    async fn positions(
        &self,
        queues: Vec<Box<[u8]>>,
    ) -> Result<(Vec<Box<[u8]>>, Vec<Position>), WireError> {
        let log = Arc::clone(&self.log);
        self.context
            .calls
            .run(move |_| {
                let positions = log.positions(&queues)?;
                Ok((queues, positions))
            })
            .await
    }

    /// Ends the stream if a replicated delete applied since the last look deleted one of its
    /// mailboxes' queues (their positions were forgotten, their messages are gone).
    fn check_not_deleted(&mut self) -> Result<(), WireError> {
        let (waiters, inbox) = (&self.context.waiters, &self.inbox);
        self.deletes_seen = super::check_not_deleted(waiters, self.deletes_seen, |queue| {
            !waiters.mailboxes_of(inbox, queue).is_empty()
        })?;
        Ok(())
    }

    /// Drops mailboxes (unknown numbers are ignored) and their wake-ups.
    fn remove(&mut self, numbers: &[u32]) {
        let removed: Vec<(u32, Mailbox)> = numbers
            .iter()
            .filter_map(|number| Some((*number, self.mailboxes.remove(number)?)))
            .collect();
        let registered: Vec<(&[u8], u32)> = removed
            .iter()
            .map(|(number, mailbox)| (&mailbox.queue[..], *number))
            .collect();
        self.context
            .waiters
            .remove_mailboxes(&self.inbox, &registered);
        self.context
            .mailboxes
            .dec_by(i64::try_from(removed.len()).unwrap_or(i64::MAX));
    }

    /// Applies one ack: whether the mailbox's position moved (none for an ack that changes
    /// nothing (already acked, or of a mailbox removed since), or why it is refused.
    fn position_for(&mut self, ack: &levee_proto::v1::MailboxAck) -> Result<bool, WireError> {
        let Some(mailbox) = self.mailboxes.get_mut(&ack.mailbox) else {
            if ack.mailbox < self.next_number {
                // Removed since: its ack no longer matters to this stream.
                return Ok(false);
            }
            return Err(invalid(format!(
                "ack of mailbox {} which was never added (mailboxes 0 to {} exist)",
                ack.mailbox,
                i64::from(self.next_number) - 1
            )));
        };
        if ack.offset >= mailbox.next {
            return Err(super::ack_past_delivered(
                &format!("mailbox {}", ack.mailbox),
                ack.offset,
                mailbox.next,
            ));
        }
        if ack.offset < mailbox.acked {
            return Ok(false);
        }
        mailbox.acked = ack.offset + 1;
        Ok(true)
    }

    /// Writes the acks' positions through the log and answers with the batch's sequence once
    /// they are durable; the wait runs beside the stream (at most [`ACK_WAITS_MAX`] at once) so
    /// delivery goes on meanwhile.
    async fn ack(&mut self, MailboxAcks { acks, sequence }: MailboxAcks) -> Result<(), WireError> {
        if acks.len() > ACKS_MAX {
            return Err(invalid(format!(
                "an ack batch holds at most {ACKS_MAX} acks, got {}",
                acks.len()
            )));
        }
        // The batch's positions go to the consumer's log in one append (a few records). The
        // acks before an invalid one are still written.
        let mut moved: Vec<u32> = Vec::with_capacity(acks.len());
        let mut refused = None;
        for ack in acks {
            match self.position_for(&ack) {
                Ok(true) => moved.push(ack.mailbox),
                Ok(false) => {}
                Err(error) => {
                    refused = Some(error);
                    break;
                }
            }
        }
        let entries: Vec<(&[u8], u64, u64)> = moved
            .iter()
            .filter_map(|number| {
                let mailbox = self.mailboxes.get(number)?;
                Some((&mailbox.queue[..], mailbox.epoch(), mailbox.acked))
            })
            .collect();
        if let Some(groups) = self.replicated()? {
            let positions = entries
                .iter()
                .map(
                    |&(queue, epoch, next)| levee_cluster::shard::ConsumerPosition {
                        queue: levee_proto::Bytes::copy_from_slice(queue),
                        epoch,
                        next,
                    },
                )
                .collect();
            return self
                .ack_replicated(groups, positions, sequence, refused)
                .await;
        }
        let (ticket, compact) = self.log.append(entries.into_iter())?;
        if compact {
            let (calls, log) = (self.context.calls.clone(), Arc::clone(&self.log));
            tokio::spawn(async move {
                let consumer = log.consumer().to_owned();
                if let Err(error) = calls.run(move |_| log.compact()).await {
                    tracing::warn!(
                        consumer,
                        %error,
                        "compacting a position log failed; retried once it has grown as much again"
                    );
                }
            });
        }
        if let Some(error) = refused {
            return Err(error);
        }
        let answer = SubscribeManyResponse {
            acked_sequence: sequence,
            ..SubscribeManyResponse::default()
        };
        if ticket.is_none() || self.context.calls.sync != levee_store::SyncPolicy::Always {
            // Durable already (under `interval` an ack is durable when buffered, as appends).
            let _ = self.outgoing.send(answer).await;
            return Ok(());
        }
        let permit = Arc::clone(&self.ack_waits)
            .acquire_owned()
            .await
            .map_err(|_| WireError::new(ErrorCode::Unavailable, "the stream is closing"))?;
        let (calls, outgoing) = (self.context.calls.clone(), self.outgoing.clone());
        tokio::spawn(async move {
            let answer = calls.durable(ticket).await.map(|()| answer);
            let _ = outgoing.send_result(answer).await;
            drop(permit);
        });
        Ok(())
    }
}

impl ManySession {
    /// The shard groups when the cluster replicates its queues.
    fn replicated(&self) -> Result<Option<levee_cluster::shard::ShardGroups>, WireError> {
        crate::queue::replicated::Replication::groups_if_replicated(
            self.context.replication.as_ref(),
        )
    }

    /// Writes an ack batch's positions through their shards and answers the batch once they
    /// are committed, after the batches before it; an invalid ack's error after the acks
    /// before it are written.
    async fn ack_replicated(
        &mut self,
        groups: levee_cluster::shard::ShardGroups,
        positions: Vec<levee_cluster::shard::ConsumerPosition>,
        sequence: u64,
        refused: Option<WireError>,
    ) -> Result<(), WireError> {
        let permit = Arc::clone(&self.ack_waits)
            .acquire_owned()
            .await
            .map_err(|_| WireError::new(ErrorCode::Unavailable, "the stream is closing"))?;
        let (done, answered) = oneshot::channel();
        let previous = self.last_ack.replace(answered);
        let consumer = self.log.consumer().to_owned();
        let outgoing = self.outgoing.clone();
        // A batch with an invalid ack is not answered: the stream ends with its error.
        let answering = refused.is_none();
        let write = tokio::spawn(async move {
            let written = if positions.is_empty() {
                Ok(())
            } else {
                crate::queue::replicated::Replication::record_positions(
                    &groups, &consumer, positions,
                )
                .await
            };
            if let Some(previous) = previous {
                let _ = previous.await;
            }
            let answer = written.map(|()| SubscribeManyResponse {
                acked_sequence: sequence,
                ..SubscribeManyResponse::default()
            });
            if answering || answer.is_err() {
                let _ = outgoing.send_result(answer).await;
            }
            let _ = done.send(());
            drop(permit);
        });
        if let Some(error) = refused {
            // The acks before the invalid one are written first.
            let _ = write.await;
            return Err(error);
        }
        Ok(())
    }
}

/// Mailboxes counted against [`MAILBOXES_MAX`], given back if not kept.
struct Reservation<'a> {
    gauge: &'a Gauge,
    count: i64,
}

impl<'a> Reservation<'a> {
    fn take(gauge: &'a Gauge, count: u32) -> Result<Self, WireError> {
        let count = i64::from(count);
        let before = gauge.inc_by(count);
        let reservation = Self { gauge, count };
        if before + count > MAILBOXES_MAX {
            return Err(WireError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "the server holds {before} mailboxes of at most {MAILBOXES_MAX}; retry later or \
                     subscribe on another server"
                ),
            ));
        }
        Ok(reservation)
    }

    /// Keeps the count (the mailboxes were added; removing them gives it back).
    fn keep(mut self) {
        self.count = 0;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.gauge.dec_by(self.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_mailbox_then_its_epoch_and_to_do_flag_share_a_word() {
        assert_eq!(std::mem::size_of::<Mailbox>(), 40);
        let epoch = (1 << 40) + 7;
        let mut mailbox = Mailbox::new(
            b"q".to_vec().into_boxed_slice(),
            Position { epoch, next: 5 },
        );
        assert!(mailbox.scheduled(), "a new mailbox is read first");
        assert_eq!(
            (mailbox.epoch(), mailbox.next, mailbox.acked),
            (epoch, 5, 5)
        );
        mailbox.set_scheduled(false);
        assert!(!mailbox.scheduled());
        assert_eq!(mailbox.epoch(), epoch);
        mailbox.set_scheduled(true);
        assert!(mailbox.scheduled());
        assert_eq!(mailbox.epoch(), epoch);
    }
}
