//! [`Subscription`]: one consumer's stream on one queue (a mailbox), with credits and acks.

use std::collections::VecDeque;

use levee_proto::WireError;
use levee_proto::v1::queues_client::QueuesClient;
use levee_proto::v1::subscribe_request::Kind;
use levee_proto::v1::{
    Ack, Credit, Delivery, ErrorCode, SubscribeRequest, SubscribeResponse, SubscribeStart,
};
use tokio::sync::mpsc;
use tonic::Streaming;
use tonic::transport::Channel;

use crate::client::Client;
use crate::error::ClientError;
use crate::following::{Members, deleted_meanwhile, deleted_while_moving, node_went_away};

/// Requests queued for the server on one subscription.
const REQUESTS_QUEUED_MAX: usize = 64;

/// A consumer's subscription to one queue. The server pushes messages as they are appended,
/// at most `credit_messages` unacked at a time; [`Subscription::ack`] marks everything up to an
/// offset done (durably) and grants that much credit back. Messages not acked are delivered
/// again to the next subscription of the same consumer.
#[derive(Debug)]
pub struct Subscription {
    requests: mpsc::Sender<SubscribeRequest>,
    responses: Streaming<SubscribeResponse>,
    start_offset: u64,
    received: VecDeque<Delivery>,
    unacked: VecDeque<(u64, u32)>,
    /// How the subscription opens again elsewhere, when it follows the cluster.
    following: Option<Following>,
}

/// What a subscription that follows the cluster keeps to open itself again elsewhere.
#[derive(Debug)]
struct Following {
    members: Members,
    queue: Vec<u8>,
    consumer: String,
    credit_messages: u32,
    /// Whether the subscription moved at least once (messages taken before may be acked).
    moved: bool,
    /// The offset after the last message handed out, over every stream (0 before any): after
    /// a move, a queue deleted meanwhile is told by it.
    delivered_until: u64,
    /// Set when the subscription ended after a move (its queue was deleted meanwhile).
    ended: Option<WireError>,
}

impl Subscription {
    pub(crate) async fn open(
        mut client: QueuesClient<Channel>,
        queue: &[u8],
        consumer: &str,
        credit_messages: u32,
    ) -> Result<Self, ClientError> {
        let (requests, receiver) = mpsc::channel(REQUESTS_QUEUED_MAX);
        let start = SubscribeRequest {
            kind: Some(Kind::Start(SubscribeStart {
                queue: queue.to_vec(),
                consumer: consumer.to_owned(),
                credit: Some(Credit {
                    messages: credit_messages,
                    bytes: 0,
                }),
            })),
        };
        // A new channel has room for its first message.
        let _ = requests.try_send(start);
        let mut responses = client
            .subscribe(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        let first = responses.message().await?.ok_or_else(|| {
            WireError::new(ErrorCode::Unavailable, "the server closed the subscription")
        })?;
        let start_offset = first.start_offset.ok_or_else(|| {
            WireError::new(
                ErrorCode::Internal,
                "the server's first subscription message has no start_offset",
            )
        })?;
        Ok(Self {
            requests,
            responses,
            start_offset,
            received: first.deliveries.into(),
            unacked: VecDeque::new(),
            following: None,
        })
    }

    /// Where delivery started: the offset after the consumer's last ack.
    pub fn start_offset(&self) -> u64 {
        self.start_offset
    }

    /// This subscription, opened through `seed`, following the cluster (whose members it
    /// learns now, so it can move when the seed is gone).
    pub(crate) async fn following(
        mut self,
        seed: Client,
        (queue, consumer, credit_messages): (&[u8], &str, u32),
    ) -> Self {
        self.following = Some(Following {
            members: Members::learned_from(seed).await,
            queue: queue.to_vec(),
            consumer: consumer.to_owned(),
            credit_messages,
            moved: false,
            delivered_until: 0,
            ended: None,
        });
        self
    }

    /// Opens the subscription again through another member (see
    /// [`Client::subscribe_following`]); `cause` when no member took it in time.
    async fn reopen(&mut self, cause: ClientError) -> Result<(), ClientError> {
        let Some(mut following) = self.following.take() else {
            return Err(cause);
        };
        let Following {
            members,
            queue,
            consumer,
            credit_messages,
            delivered_until,
            ..
        } = &mut following;
        let (queue, consumer, credit_messages) = (&*queue, &*consumer, *credit_messages);
        let delivered: Vec<(Vec<u8>, u64)> = if *delivered_until > 0 {
            vec![(queue.clone(), *delivered_until)]
        } else {
            Vec::new()
        };
        let delivered = &delivered;
        let reopened = members
            .reopen(|member| async move {
                let fresh = Self::open(member.queues_client(), queue, consumer, credit_messages)
                    .await
                    .ok()?;
                let deleted = deleted_meanwhile(&member, delivered).await.ok()?;
                Some((fresh, deleted))
            })
            .await;
        let Some((mut fresh, deleted)) = reopened else {
            self.following = Some(following);
            return Err(cause);
        };
        following.moved = true;
        if let Some(queue) = deleted {
            let ended = deleted_while_moving(&queue);
            following.ended = Some(ended.clone());
            self.following = Some(following);
            return Err(ended.into());
        }
        fresh.following = Some(following);
        *self = fresh;
        Ok(())
    }

    /// The next message, waiting until one is appended; `None` when the server ended the
    /// subscription cleanly. A following subscription whose node went away opens itself again
    /// elsewhere and goes on from the consumer's last confirmed ack.
    pub async fn next(&mut self) -> Result<Option<Delivery>, ClientError> {
        loop {
            match self.next_once().await {
                Err(error) if self.following.is_some() && node_went_away(&error) => {
                    self.reopen(error).await?;
                }
                next => return next,
            }
        }
    }

    async fn next_once(&mut self) -> Result<Option<Delivery>, ClientError> {
        if let Some(ended) = self
            .following
            .as_ref()
            .and_then(|following| following.ended.clone())
        {
            return Err(ended.into());
        }
        loop {
            if let Some(delivery) = self.received.pop_front() {
                let bytes = u32::try_from(delivery.payload.len()).unwrap_or(u32::MAX);
                self.unacked.push_back((delivery.offset, bytes));
                if let Some(following) = &mut self.following {
                    following.delivered_until = following.delivered_until.max(delivery.offset + 1);
                }
                return Ok(Some(delivery));
            }
            match self.responses.message().await? {
                Some(response) => self.received.extend(response.deliveries),
                None => return Ok(None),
            }
        }
    }

    /// Why the stream ended, once sending to it failed: the server's error if it sent one.
    async fn ended(&mut self) -> ClientError {
        loop {
            match self.responses.message().await {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return WireError::new(ErrorCode::Unavailable, "the subscription is closed")
                        .into();
                }
                Err(status) => return status.into(),
            }
        }
    }

    /// Marks every delivered message up to and including `offset` done and grants their credit
    /// back; returns once the server has made the ack durable. Messages that arrive meanwhile
    /// wait for [`Subscription::next`].
    pub async fn ack(&mut self, offset: u64) -> Result<(), ClientError> {
        if let Some(following) = &self.following
            && following.moved
            && self
                .unacked
                .back()
                .is_none_or(|&(delivered, _)| delivered < offset)
        {
            // A message the stream took before it moved, not delivered again yet: confirmed
            // already if the new stream starts after it, else its ack cannot be recorded (the
            // server would end the stream for an ack past what it delivered).
            if offset < self.start_offset {
                return Ok(());
            }
            return Err(WireError::new(
                ErrorCode::Unavailable,
                format!(
                    "offset {offset} was delivered before the subscription moved to another node \
                     and its ack was not confirmed; the subscription delivers it again from \
                     offset {}",
                    self.start_offset
                ),
            )
            .into());
        }
        match self.ack_once(offset).await {
            Err(error) if self.following.is_some() && node_went_away(&error) => {
                self.reopen(error).await?;
                if offset < self.start_offset {
                    // Confirmed after all: the stream opened again after it.
                    return Ok(());
                }
                Err(WireError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the subscription's node went away before the ack of offset {offset} was \
                         confirmed; the subscription is open again through another node from \
                         offset {} and delivers the unconfirmed messages again",
                        self.start_offset
                    ),
                )
                .into())
            }
            acked => acked,
        }
    }

    async fn ack_once(&mut self, offset: u64) -> Result<(), ClientError> {
        let (mut messages, mut bytes) = (0_u32, 0_u32);
        while let Some(&(delivered, size)) = self.unacked.front() {
            if delivered > offset {
                break;
            }
            self.unacked.pop_front();
            messages += 1;
            bytes = bytes.saturating_add(size);
        }
        let closed = || WireError::new(ErrorCode::Unavailable, "the subscription is closed");
        let ack = SubscribeRequest {
            kind: Some(Kind::Ack(Ack { offset })),
        };
        if self.requests.send(ack).await.is_err() {
            return Err(self.ended().await);
        }
        if messages > 0 {
            let credit = SubscribeRequest {
                kind: Some(Kind::Credit(Credit { messages, bytes })),
            };
            // The server may have ended the stream on the ack (a protocol error): then its
            // error, not the closed channel, is the answer.
            if self.requests.send(credit).await.is_err() {
                return Err(self.ended().await);
            }
        }
        loop {
            let response = self.responses.message().await?.ok_or_else(closed)?;
            self.received.extend(response.deliveries);
            if response.acked_offset > offset {
                return Ok(());
            }
        }
    }
}
