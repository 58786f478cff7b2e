//! A node's appender of each shard ([`ShardGroups::append`], used while the node leads the
//! shard): append requests bound for the shard wait in its queue; the appender writes what waits as one entry
//! ([`ShardCommand::Appends`]) while at most [`APPEND_ENTRIES_IN_FLIGHT`] of its entries are
//! being committed, so however many requests a node takes, each shard costs about one entry
//! per commit round, and a lone request goes at once.
//!
//! An entry's requests keep the order they reached the queue, and entries are proposed in
//! the order they were made; each request is applied and answered on its own, as if it had
//! its own entry (a refused one stores nothing and does not touch the others). A write that
//! fails fails for each of its requests, with the same error.

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot, watch};

use crate::shard::groups::{ShardGroups, ShardWriteError};
use crate::shard::{AppendRequest, QueueMessage, ShardCommand, ShardId, ShardResponse};

/// Append requests that may wait for a shard's appender at once (more wait to be queued:
/// back-pressure on the node's append calls).
pub const APPENDS_QUEUED_MAX: usize = 4_096;
/// Entries of a shard's appender being committed at once: the next entry gathers what
/// arrives meanwhile.
pub const APPEND_ENTRIES_IN_FLIGHT: usize = 2;
/// Messages after which no more requests join an entry ...
pub const APPEND_MESSAGES_PER_ENTRY_MAX: usize = 10_000;
/// ... and payload bytes (a request alone may be larger; an entry stays within
/// `PEER_MESSAGE_BYTES_MAX / APPEND_ENTRIES_MAX`).
pub const APPEND_BYTES_PER_ENTRY_MAX: usize = 8 << 20;

/// The outcome of one append request.
pub type AppendOutcome = Result<ShardResponse, ShardWriteError>;

/// One append request waiting for its shard's appender, and where its outcome goes.
#[derive(Debug)]
pub struct AppendWrite {
    request: AppendRequest,
    bytes: usize,
    done: oneshot::Sender<AppendOutcome>,
}

impl AppendWrite {
    /// `producer`'s (if any) request to append `messages`, answered on the returned receiver.
    pub fn new(
        producer: Option<String>,
        messages: Vec<QueueMessage>,
    ) -> (Self, oneshot::Receiver<AppendOutcome>) {
        let bytes = messages
            .iter()
            .map(|message| message.queue.len() + message.payload.len())
            .sum();
        let (done, outcome) = oneshot::channel();
        let write = Self {
            request: AppendRequest { producer, messages },
            bytes,
            done,
        };
        (write, outcome)
    }
}

/// Takes `first` and the requests queued behind it while the entry stays within
/// [`APPEND_MESSAGES_PER_ENTRY_MAX`] and [`APPEND_BYTES_PER_ENTRY_MAX`]; a request that would
/// take it past them is left in `carry`, first of the next entry.
fn gather(
    first: AppendWrite,
    queue: &mut mpsc::Receiver<AppendWrite>,
    carry: &mut Option<AppendWrite>,
) -> Vec<AppendWrite> {
    let (mut messages, mut bytes) = (first.request.messages.len(), first.bytes);
    let mut batch = vec![first];
    while let Ok(next) = queue.try_recv() {
        if messages + next.request.messages.len() > APPEND_MESSAGES_PER_ENTRY_MAX
            || bytes + next.bytes > APPEND_BYTES_PER_ENTRY_MAX
        {
            *carry = Some(next);
            break;
        }
        messages += next.request.messages.len();
        bytes += next.bytes;
        batch.push(next);
    }
    batch
}

/// Writes `batch` as one entry of `shard` and answers each request.
async fn write(groups: ShardGroups, shard: ShardId, mut batch: Vec<AppendWrite>) {
    if batch.len() == 1
        && let Some(only) = batch.pop()
    {
        let AppendRequest { producer, messages } = only.request;
        let outcome = groups
            .write(shard, ShardCommand::Append { producer, messages })
            .await;
        if outcome.is_ok() {
            groups.observer().appends_written(shard, 1);
        }
        let _ = only.done.send(outcome);
        return;
    }
    let (requests, answers): (Vec<_>, Vec<_>) = batch
        .into_iter()
        .map(|write| (write.request, write.done))
        .unzip();
    let count = requests.len();
    match groups
        .write(shard, ShardCommand::Appends { requests })
        .await
    {
        Ok(ShardResponse::Each { responses }) if responses.len() == count => {
            groups.observer().appends_written(shard, count);
            for (answer, response) in answers.into_iter().zip(responses) {
                let _ = answer.send(Ok(response));
            }
        }
        Ok(other) => {
            // Never expected: each caller sees what the shard answered, as for a lone append.
            for answer in answers {
                let _ = answer.send(Ok(other.clone()));
            }
        }
        Err(error) => {
            for answer in answers {
                let _ = answer.send(Err(error.clone()));
            }
        }
    }
}

/// `shard`'s appender on `groups`: takes the requests of `queue` until it closes or
/// `stopping` is set (the writes under way are then dropped: their callers learn the node is
/// stopping).
pub async fn run(
    groups: ShardGroups,
    shard: ShardId,
    mut queue: mpsc::Receiver<AppendWrite>,
    mut stopping: watch::Receiver<bool>,
) {
    let mut in_flight = FuturesUnordered::new();
    let mut carry: Option<AppendWrite> = None;
    loop {
        tokio::select! {
            // The writes under way first: a new entry's write is polled, and so proposed,
            // before the next entry is made.
            biased;
            _ = stopping.wait_for(|stopping| *stopping) => return,
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            first = async {
                match carry.take() {
                    Some(first) => Some(first),
                    None => queue.recv().await,
                }
            }, if in_flight.len() < APPEND_ENTRIES_IN_FLIGHT => {
                let Some(first) = first else { break };
                let batch = gather(first, &mut queue, &mut carry);
                in_flight.push(write(groups.clone(), shard, batch));
            }
        }
    }
    while in_flight.next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_proto::Bytes;

    fn request(messages: usize, payload_bytes: usize) -> AppendWrite {
        let messages = (0..messages)
            .map(|_| QueueMessage {
                queue: Bytes::from_static(b"q"),
                payload: Bytes::from(vec![1_u8; payload_bytes]),
                sequence: 0,
            })
            .collect();
        AppendWrite::new(None, messages).0
    }

    #[test]
    fn given_queued_requests_when_gathered_then_they_join_until_an_entry_is_full() {
        let (sender, mut queue) = mpsc::channel(16);
        for _ in 0..3 {
            assert!(sender.try_send(request(4_000, 1)).is_ok());
        }
        let mut carry = None;
        let batch = gather(request(1, 1), &mut queue, &mut carry);
        assert_eq!(
            batch.len(),
            3,
            "the first and two of 4,000 messages fit in 10,000"
        );
        let carried = carry.take().map(|write| write.request.messages.len());
        assert_eq!(carried, Some(4_000), "the third waits for the next entry");
        assert!(queue.try_recv().is_err());
    }

    #[test]
    fn given_large_requests_when_gathered_then_bytes_bound_the_entry_but_not_a_lone_request() {
        let (sender, mut queue) = mpsc::channel(16);
        assert!(sender.try_send(request(1, 5 << 20)).is_ok());
        let mut carry = None;
        let batch = gather(request(1, 9 << 20), &mut queue, &mut carry);
        assert_eq!(batch.len(), 1, "a request over the bound goes alone");
        assert!(carry.is_some());
        let next = carry
            .take()
            .map(|first| gather(first, &mut queue, &mut carry));
        assert_eq!(next.map(|batch| batch.len()), Some(1));
    }
}
