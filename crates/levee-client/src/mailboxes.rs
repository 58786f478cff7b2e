//! [`Mailboxes`]: one consumer's stream over many queues at once, with one credit and batched
//! acks.

use std::collections::{HashMap, VecDeque};

use levee_proto::WireError;
use levee_proto::v1::queues_client::QueuesClient;
use levee_proto::v1::subscribe_many_request::Kind;
use levee_proto::v1::{
    AddMailboxes, Credit, ErrorCode, MailboxAck, MailboxAcks, MailboxDelivery, RemoveMailboxes,
    SubscribeManyRequest, SubscribeManyResponse, SubscribeManyStart,
};
use tokio::sync::mpsc;
use tonic::Streaming;
use tonic::transport::Channel;

use crate::client::Client;
use crate::error::ClientError;
use crate::following::{Members, deleted_meanwhile, deleted_while_moving, node_went_away};

/// Requests queued for the server on one stream.
const REQUESTS_QUEUED_MAX: usize = 64;
/// Most queues (or mailbox numbers) one add or remove request carries (the server's bound).
pub const MAILBOXES_PER_REQUEST_MAX: usize = 10_000;
/// Acks buffered before [`Mailboxes::next`] sends them without being asked.
const ACKS_BUFFERED_MAX: usize = 1_024;

/// A consumer's stream over many queues (an app server holding its connected users'
/// mailboxes). [`Mailboxes::add`] numbers the queues it adds in order (0, 1, ...); every
/// delivery names its mailbox by that number, and the server pushes messages of any of them as
/// they are appended.
///
/// Credit covers the whole stream: at most `credit_messages` delivered and not yet taken by
/// [`Mailboxes::next`]; taken messages give their credit back. Acks are cumulative per mailbox
/// and buffered: [`Mailboxes::ack`] records one, `next` sends them (at least once a thousand
/// are waiting, and whenever it is about to wait for the server), and
/// [`Mailboxes::flush_acks`] sends them and returns once they are durable. Messages not acked
/// are delivered again to the next subscription of the same consumer, on this kind of stream
/// or a single-queue [`crate::Subscription`] (they share the consumer's positions).
#[derive(Debug)]
pub struct Mailboxes {
    requests: mpsc::Sender<SubscribeManyRequest>,
    responses: Streaming<SubscribeManyResponse>,
    received: VecDeque<MailboxDelivery>,
    /// Mailbox numbers asked for so far.
    added: u32,
    /// Mailbox numbers the server confirmed.
    confirmed: u32,
    credit_messages: u32,
    taken_messages: u32,
    taken_bytes: u32,
    acks: HashMap<u32, u64>,
    ack_sequence: u64,
    acked_sequence: u64,
    /// How the stream opens again elsewhere, when it follows the cluster.
    following: Option<Following>,
}

/// What a stream that follows the cluster keeps to open itself again through another node.
#[derive(Debug)]
struct Following {
    members: Members,
    consumer: String,
    /// Every queue added, in mailbox order.
    queues: Vec<Vec<u8>>,
    /// Mailbox numbers removed.
    removed: std::collections::BTreeSet<u32>,
    /// Once the stream moved: the highest offset each mailbox delivered on the current stream
    /// (an ack of a message taken before the move is kept within it).
    delivered: Option<HashMap<u32, u64>>,
    /// The offset after the last message handed out, by mailbox, over every stream: after a
    /// move, a queue deleted meanwhile is told by it.
    delivered_until: HashMap<u32, u64>,
    /// Set when the stream ended after a move (a queue of it was deleted meanwhile).
    ended: Option<WireError>,
}

impl Mailboxes {
    /// This stream, opened through `seed` for `consumer`, following the cluster (whose
    /// members it learns now, so it can move when the seed is gone).
    pub(crate) async fn following(mut self, seed: Client, consumer: &str) -> Self {
        self.following = Some(Following {
            members: Members::learned_from(seed).await,
            consumer: consumer.to_owned(),
            queues: Vec::new(),
            removed: std::collections::BTreeSet::new(),
            delivered: None,
            delivered_until: HashMap::new(),
            ended: None,
        });
        self
    }

    /// Opens the stream again through another member (see
    /// [`Client::subscribe_many_following`]); `cause` is returned when no member took it in
    /// time.
    async fn reopen(&mut self, cause: ClientError) -> Result<(), ClientError> {
        let Some(mut following) = self.following.take() else {
            return Err(cause);
        };
        let credit_messages = self.credit_messages;
        let Following {
            members,
            consumer,
            queues,
            removed,
            delivered_until,
            ..
        } = &mut following;
        let (consumer, queues, removed) = (&*consumer, &*queues, &*removed);
        let mut delivered: HashMap<&[u8], u64> = HashMap::new();
        for (mailbox, until) in delivered_until.iter() {
            if let Some(queue) = queues.get(*mailbox as usize)
                && !removed.contains(mailbox)
            {
                let at = delivered.entry(queue.as_slice()).or_default();
                *at = (*at).max(*until);
            }
        }
        let delivered: Vec<(Vec<u8>, u64)> = delivered
            .into_iter()
            .map(|(queue, until)| (queue.to_vec(), until))
            .collect();
        let delivered = &delivered;
        let reopened = members
            .reopen(|member| async move {
                let mut fresh = Self::open(member.queues_client(), consumer, credit_messages)
                    .await
                    .ok()?;
                let queues: Vec<&[u8]> = queues.iter().map(Vec::as_slice).collect();
                fresh.add_once(&queues).await.ok()?;
                let removed: Vec<u32> = removed.iter().copied().collect();
                fresh.remove_once(&removed).await.ok()?;
                let deleted = deleted_meanwhile(&member, delivered).await.ok()?;
                Some((fresh, deleted))
            })
            .await;
        let Some((mut fresh, deleted)) = reopened else {
            self.following = Some(following);
            return Err(cause);
        };
        if let Some(queue) = deleted {
            let ended = deleted_while_moving(&queue);
            following.ended = Some(ended.clone());
            self.following = Some(following);
            return Err(ended.into());
        }
        // Removed mailboxes' messages the new stream sent before their removal reached it are
        // not handed out (their credit goes back).
        let mut early: Vec<MailboxDelivery> = fresh.received.drain(..).collect();
        let (messages, bytes) = drop_removed(&following.removed, &mut early);
        fresh.received.extend(early);
        fresh.taken_messages += messages;
        fresh.taken_bytes = fresh.taken_bytes.saturating_add(bytes);
        // What the new stream delivered while its queues were added again counts too.
        let mut delivered = HashMap::new();
        note_delivered(&mut delivered, fresh.received.iter());
        following.delivered = Some(delivered);
        fresh.following = Some(following);
        *self = fresh;
        Ok(())
    }

    pub(crate) async fn open(
        mut client: QueuesClient<Channel>,
        consumer: &str,
        credit_messages: u32,
    ) -> Result<Self, ClientError> {
        let (requests, receiver) = mpsc::channel(REQUESTS_QUEUED_MAX);
        let start = SubscribeManyRequest {
            kind: Some(Kind::Start(SubscribeManyStart {
                consumer: consumer.to_owned(),
                credit: Some(Credit {
                    messages: credit_messages,
                    bytes: 0,
                }),
            })),
        };
        // A new channel has room for its first message.
        let _ = requests.try_send(start);
        let responses = client
            .subscribe_many(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        Ok(Self {
            requests,
            responses,
            received: VecDeque::new(),
            added: 0,
            confirmed: 0,
            credit_messages,
            taken_messages: 0,
            taken_bytes: 0,
            acks: HashMap::new(),
            ack_sequence: 0,
            acked_sequence: 0,
            following: None,
        })
    }

    /// Adds `queues` (each at most once per stream) and returns once the server has registered
    /// them: their mailbox numbers, in order. Delivery of each starts after the consumer's last
    /// ack on it. Messages that arrive meanwhile wait for [`Mailboxes::next`]. A queue being
    /// deleted is added once its delete has returned (from the start of the queue created
    /// again); if that takes over 5 s the server ends the stream (`UNAVAILABLE`).
    pub async fn add(&mut self, queues: &[&[u8]]) -> Result<std::ops::Range<u32>, ClientError> {
        let first = self.added;
        if let Some(following) = &mut self.following {
            following
                .queues
                .extend(queues.iter().map(|queue| queue.to_vec()));
        }
        match self.add_once(queues).await {
            Err(error) if self.following.is_some() && node_went_away(&error) => {
                // Opened again elsewhere with every queue added, these included.
                self.reopen(error).await?;
                Ok(first..self.added)
            }
            Err(error) => {
                if let Some(following) = &mut self.following {
                    following.queues.truncate(first as usize);
                }
                Err(error)
            }
            added => added,
        }
    }

    async fn add_once(&mut self, queues: &[&[u8]]) -> Result<std::ops::Range<u32>, ClientError> {
        let first = self.added;
        for chunk in queues.chunks(MAILBOXES_PER_REQUEST_MAX) {
            let add = AddMailboxes {
                queues: chunk.iter().map(|queue| queue.to_vec()).collect(),
            };
            self.send(Kind::Add(add)).await?;
            self.added += u32::try_from(chunk.len()).unwrap_or(u32::MAX);
        }
        while self.confirmed < self.added {
            if !self.receive().await? {
                return Err(closed().into());
            }
        }
        Ok(first..self.added)
    }

    /// Stops delivery from `mailboxes` (their numbers are not reused). Acks recorded before
    /// are sent first, so they still count; messages of theirs already received are still
    /// returned by [`Mailboxes::next`] (acks of those are ignored).
    pub async fn remove(&mut self, mailboxes: &[u32]) -> Result<(), ClientError> {
        if let Some(following) = &mut self.following {
            following.removed.extend(mailboxes.iter().copied());
        }
        match self.remove_once(mailboxes).await {
            // Opened again elsewhere with these removed.
            Err(error) if self.following.is_some() && node_went_away(&error) => {
                self.reopen(error).await
            }
            removed => removed,
        }
    }

    async fn remove_once(&mut self, mailboxes: &[u32]) -> Result<(), ClientError> {
        if mailboxes.is_empty() {
            return Ok(());
        }
        self.send_acks().await?;
        for chunk in mailboxes.chunks(MAILBOXES_PER_REQUEST_MAX) {
            let remove = RemoveMailboxes {
                mailboxes: chunk.to_vec(),
            };
            self.send(Kind::Remove(remove)).await?;
        }
        Ok(())
    }

    /// The next message of any mailbox, waiting until one is appended; `None` when the server
    /// ended the stream cleanly.
    pub async fn next(&mut self) -> Result<Option<MailboxDelivery>, ClientError> {
        Ok(self.next_batch(1).await?.pop())
    }

    /// Every message received and not yet taken, at most `max` (at least one; waits until one
    /// is appended); empty when the server ended the stream cleanly. As [`Mailboxes::next`]
    /// for a batch: one call per response instead of one per message.
    pub async fn next_batch(&mut self, max: usize) -> Result<Vec<MailboxDelivery>, ClientError> {
        loop {
            match self.next_batch_once(max).await {
                Err(error) if self.following.is_some() && node_went_away(&error) => {
                    self.reopen(error).await?;
                }
                taken => return taken,
            }
        }
    }

    async fn next_batch_once(&mut self, max: usize) -> Result<Vec<MailboxDelivery>, ClientError> {
        if let Some(ended) = self
            .following
            .as_ref()
            .and_then(|following| following.ended.clone())
        {
            return Err(ended.into());
        }
        while self.received.is_empty() {
            // About to wait: give back all the credit taken and send the acks.
            self.grant_credit().await?;
            self.send_acks().await?;
            if !self.receive().await? {
                return Ok(Vec::new());
            }
        }
        let count = self.received.len().min(max.max(1));
        let batch: Vec<MailboxDelivery> = self.received.drain(..count).collect();
        if let Some(following) = &mut self.following {
            for delivery in &batch {
                let until = following
                    .delivered_until
                    .entry(delivery.mailbox)
                    .or_default();
                *until = (*until).max(delivery.offset + 1);
            }
        }
        let bytes: usize = batch.iter().map(|delivery| delivery.payload.len()).sum();
        self.taken_messages += u32::try_from(count).unwrap_or(u32::MAX);
        self.taken_bytes = self
            .taken_bytes
            .saturating_add(u32::try_from(bytes).unwrap_or(u32::MAX));
        if self.taken_messages >= self.credit_messages.div_ceil(2) {
            self.grant_credit().await?;
        }
        if self.acks.len() >= ACKS_BUFFERED_MAX {
            self.send_acks().await?;
        }
        Ok(batch)
    }

    /// Records that every message of `mailbox` up to and including `offset` is done (it must
    /// have been delivered). Sent by [`Mailboxes::next`] or [`Mailboxes::flush_acks`].
    ///
    /// After a following stream moved, an ack of a message taken before the move is kept
    /// within what the new stream delivered of its mailbox (dropped if nothing yet): the
    /// server ends a stream acked past what it delivered, and the messages not acked are
    /// delivered again.
    pub fn ack(&mut self, mailbox: u32, offset: u64) {
        let offset = match self
            .following
            .as_ref()
            .and_then(|following| following.delivered.as_ref())
        {
            Some(delivered) => match delivered.get(&mailbox) {
                Some(&last) => offset.min(last),
                None => return,
            },
            None => offset,
        };
        let acked = self.acks.entry(mailbox).or_insert(offset);
        *acked = (*acked).max(offset);
    }

    /// Sends the recorded acks and returns once they (and every ack sent before) are durable.
    /// Messages that arrive meanwhile wait for [`Mailboxes::next`].
    pub async fn flush_acks(&mut self) -> Result<(), ClientError> {
        match self.flush_acks_once().await {
            Err(error) if self.following.is_some() && node_went_away(&error) => {
                // The acks not confirmed are lost with the stream: say so, once open again.
                self.reopen(error).await?;
                Err(WireError::new(
                    ErrorCode::Unavailable,
                    "the stream's node went away before the acks were confirmed; the stream is \
                     open again through another node and delivers the unconfirmed messages again",
                )
                .into())
            }
            flushed => flushed,
        }
    }

    async fn flush_acks_once(&mut self) -> Result<(), ClientError> {
        self.send_acks().await?;
        while self.acked_sequence < self.ack_sequence {
            if !self.receive().await? {
                return Err(closed().into());
            }
        }
        Ok(())
    }

    async fn send(&mut self, kind: Kind) -> Result<(), ClientError> {
        let request = SubscribeManyRequest { kind: Some(kind) };
        if self.requests.send(request).await.is_ok() {
            return Ok(());
        }
        // The stream is gone: the server's reason, if it gave one.
        loop {
            match self.responses.message().await {
                Err(status) => return Err(status.into()),
                Ok(None) => return Err(closed().into()),
                Ok(Some(_)) => {}
            }
        }
    }

    async fn grant_credit(&mut self) -> Result<(), ClientError> {
        if self.taken_messages == 0 {
            return Ok(());
        }
        let credit = Credit {
            messages: self.taken_messages,
            bytes: self.taken_bytes,
        };
        (self.taken_messages, self.taken_bytes) = (0, 0);
        self.send(Kind::Credit(credit)).await
    }

    async fn send_acks(&mut self) -> Result<(), ClientError> {
        if self.acks.is_empty() {
            return Ok(());
        }
        let acks: Vec<MailboxAck> = self
            .acks
            .drain()
            .map(|(mailbox, offset)| MailboxAck { mailbox, offset })
            .collect();
        for chunk in acks.chunks(MAILBOXES_PER_REQUEST_MAX) {
            self.ack_sequence += 1;
            let batch = MailboxAcks {
                acks: chunk.to_vec(),
                sequence: self.ack_sequence,
            };
            self.send(Kind::Ack(batch)).await?;
        }
        Ok(())
    }

    /// Takes one response from the server; false when the stream ended cleanly.
    async fn receive(&mut self) -> Result<bool, ClientError> {
        let Some(response) = self.responses.message().await? else {
            return Ok(false);
        };
        let mut deliveries = response.deliveries;
        if let Some(Following {
            removed,
            delivered: Some(delivered),
            ..
        }) = &mut self.following
        {
            // Moved: removed mailboxes' messages still on their way are not handed out.
            let (messages, bytes) = drop_removed(removed, &mut deliveries);
            self.taken_messages += messages;
            self.taken_bytes = self.taken_bytes.saturating_add(bytes);
            note_delivered(delivered, deliveries.iter());
        }
        self.received.extend(deliveries);
        self.confirmed = self.confirmed.max(response.mailboxes_added);
        self.acked_sequence = self.acked_sequence.max(response.acked_sequence);
        Ok(true)
    }
}

/// Drops the messages of `removed` mailboxes from `deliveries`; how many, and their bytes
/// (counted as taken, so their credit goes back).
fn drop_removed(
    removed: &std::collections::BTreeSet<u32>,
    deliveries: &mut Vec<MailboxDelivery>,
) -> (u32, u32) {
    let (mut messages, mut bytes) = (0_u32, 0_u32);
    if !removed.is_empty() {
        deliveries.retain(|delivery| {
            let keep = !removed.contains(&delivery.mailbox);
            if !keep {
                messages += 1;
                bytes =
                    bytes.saturating_add(u32::try_from(delivery.payload.len()).unwrap_or(u32::MAX));
            }
            keep
        });
    }
    (messages, bytes)
}

/// Raises each mailbox's highest delivered offset in `delivered` to `deliveries`'.
fn note_delivered<'a>(
    delivered: &mut HashMap<u32, u64>,
    deliveries: impl Iterator<Item = &'a MailboxDelivery>,
) {
    for delivery in deliveries {
        let last = delivered.entry(delivery.mailbox).or_insert(delivery.offset);
        *last = (*last).max(delivery.offset);
    }
}

fn closed() -> WireError {
    WireError::new(ErrorCode::Unavailable, "the subscription is closed")
}
