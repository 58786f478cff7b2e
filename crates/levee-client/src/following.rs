//! What a stream that follows the cluster keeps to open itself again through another node when
//! its node goes away ([`crate::Client::subscribe_many_following`],
//! [`crate::Client::subscribe_following`]): the cluster's members, learned from the node the
//! stream was opened through or from the members known, tried in turn.

use std::time::Duration;

use levee_proto::v1::ErrorCode;

use crate::client::{Client, ClientOptions};
use crate::error::ClientError;

/// Longest a following stream tries to open itself again before it gives up.
const REOPEN_WITHIN: Duration = Duration::from_secs(30);
/// Pause between two rounds over the members while none takes the stream.
const REOPEN_PAUSE: Duration = Duration::from_millis(100);

/// Whether `error` means the stream's node went away (not a refusal of what was asked).
pub(crate) fn node_went_away(error: &ClientError) -> bool {
    matches!(error.code(), Some(ErrorCode::Unavailable) | None)
}

/// The members a following stream may move to.
#[derive(Debug)]
pub(crate) struct Members {
    /// The node the stream was opened through, asked for the members first.
    seed: Client,
    /// The members last learned.
    known: Vec<Client>,
    /// The member to try first at the next move.
    next: usize,
}

impl Members {
    /// The members as `seed` says now.
    pub(crate) async fn learned_from(seed: Client) -> Self {
        let mut members = Self {
            seed,
            known: Vec::new(),
            next: 0,
        };
        members.learn().await;
        members
    }

    /// Learns the members again: from the seed, else from any member known; keeps the last
    /// list known when none answers.
    pub(crate) async fn learn(&mut self) {
        let asked: Vec<Client> = std::iter::once(self.seed.clone())
            .chain(self.known.iter().cloned())
            .collect();
        let options = ClientOptions {
            connect_timeout: Duration::from_secs(1),
            ..ClientOptions::default()
        };
        for client in asked {
            let Ok(cluster) = client.cluster().await else {
                continue;
            };
            let members: Vec<Client> = cluster
                .members
                .iter()
                .filter(|member| !member.grpc_addr.is_empty())
                .filter_map(|member| Client::connect_lazy(&member.grpc_addr, &options).ok())
                .collect();
            if !members.is_empty() {
                self.known = members;
                return;
            }
        }
        if self.known.is_empty() {
            self.known.push(self.seed.clone());
        }
    }

    /// The next member that answers within `probe` (the members learned again first, then
    /// walked in their order from the one after the last picked, so the members of a group
    /// whose node went away all land on the same next one); the seed when none answers.
    pub(crate) async fn next_member(&mut self, probe: Duration) -> Client {
        self.learn().await;
        let count = self.known.len();
        for step in 1..=count {
            let index = (self.next + step) % count;
            let member = self.known[index].clone();
            if matches!(
                tokio::time::timeout(probe, member.server_info()).await,
                Ok(Ok(_))
            ) {
                self.next = index;
                return member;
            }
        }
        self.seed.clone()
    }

    /// Tries `open` on each member in turn (the one after the last that took the stream
    /// first), learning the members again before each round, until one opens the stream or
    /// [`REOPEN_WITHIN`] has passed (`None`).
    pub(crate) async fn reopen<T, Open, Opening>(&mut self, mut open: Open) -> Option<T>
    where
        Open: FnMut(Client) -> Opening,
        Opening: std::future::Future<Output = Option<T>>,
    {
        let started = tokio::time::Instant::now();
        loop {
            self.learn().await;
            let count = self.known.len();
            for step in 0..count {
                let member = self.known[(self.next + step) % count].clone();
                if let Some(opened) = open(member).await {
                    self.next = (self.next + step + 1) % count;
                    return Some(opened);
                }
            }
            if started.elapsed() >= REOPEN_WITHIN {
                return None;
            }
            tokio::time::sleep(REOPEN_PAUSE).await;
        }
    }
}

/// How many `GetQueueInfo` calls a stream makes at once after a move, to learn whether a
/// queue it delivered from was deleted meanwhile ([`deleted_meanwhile`]).
const INFO_CHECKS_AT_ONCE: usize = 64;

/// After a move through `member`: a queue of `delivered` (each queue and the offset after the
/// last message delivered from it) that was deleted while the stream moved, if any. A delete
/// the old stream did not live to see is not seen by the new one either (the queue is then
/// one that does not exist, or a new one under the name), so the stream asks: a queue that
/// does not exist, or whose next offset is below what was delivered, was deleted. (A queue
/// created again with more messages than were delivered is not told apart.) Another failure
/// of the calls is returned, as the member refusing the stream.
pub(crate) async fn deleted_meanwhile(
    member: &Client,
    delivered: &[(Vec<u8>, u64)],
) -> Result<Option<Vec<u8>>, ClientError> {
    for chunk in delivered.chunks(INFO_CHECKS_AT_ONCE) {
        let mut checks = tokio::task::JoinSet::new();
        for (queue, until) in chunk {
            let (member, queue, until) = (member.clone(), queue.clone(), *until);
            checks.spawn(async move {
                match member.queue_info(&queue).await {
                    Ok(info) => Ok((info.next_offset < until).then_some(queue)),
                    Err(error) if error.code() == Some(ErrorCode::NotFound) => Ok(Some(queue)),
                    Err(error) => Err(error),
                }
            });
        }
        while let Some(checked) = checks.join_next().await {
            let checked = checked.map_err(|error| {
                levee_proto::WireError::new(ErrorCode::Internal, error.to_string())
            })?;
            if let Some(queue) = checked? {
                return Ok(Some(queue));
            }
        }
    }
    Ok(None)
}

/// The error that ends a following stream whose `queue` was deleted while it moved.
pub(crate) fn deleted_while_moving(queue: &[u8]) -> levee_proto::WireError {
    levee_proto::WireError::new(
        ErrorCode::FailedPrecondition,
        format!(
            "queue '{}' was deleted while this stream moved to another node: its messages and \
             the consumer's position on it are gone; open the stream again to read a queue \
             created again under the name, from offset 0",
            String::from_utf8_lossy(queue)
        ),
    )
}
