//! Many-queue streams spread over nodes ([`SpreadSession`]). In a cluster that replicates its
//! queues, a node holds the replicas of every shard only while the cluster has up to three
//! voters; a voter beyond the third (or a learner) holds some shards or none. A `SubscribeMany`
//! stream opened there is served in **parts**: the queues of shards this node holds by a
//! [`ManySession`] here, those of each other shard by a `SubscribeMany` stream to the shard's
//! preferred replica (one per node, marked forwarded so that it is served there and never
//! forwarded again). The client sees one stream with the contract of `SubscribeMany`:
//!
//! - *Numbers.* The client's mailbox numbers are given here in add order; each part numbers its
//!   own mailboxes, and deliveries and acks are mapped both ways.
//! - *Credit.* Each part gets the client's start credit, and deliveries wait here until the
//!   client's credit lets them go; each message handed on gives its part one message and its
//!   bytes of credit back. So the client never holds more than it granted, and this node holds
//!   what the parts' credit allows (bounded by the credit caps per part).
//! - *Answers in order.* An add is answered (`mailboxes_added`) once every part it went to
//!   registered its queues, and no delivery of its mailboxes goes before that answer; an ack
//!   batch (`acked_sequence`) once every part it went to confirmed its share, batches in the
//!   client's order. Checks the client can break (names, duplicates, bounds, unknown
//!   mailboxes, acks past what this stream handed on) are made here, with the messages a
//!   single node gives (for a mailbox its part sent nothing of yet, the part judges an ack
//!   against what it delivered, which may include messages still on their way here). A
//!   client that ends its side still gets its ack batches written and answered (within 5 s).
//! - *Memory.* Only live mailboxes are kept (a removed one is forgotten, its number never given
//!   again), as on a single node.
//! - *Errors.* A part that ends (its node went down, its shard lost its quorum, a refusal) ends
//!   the whole stream with its error: acks not confirmed are delivered again on the next
//!   subscription, as on any stream that ends.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use levee_cluster::NodeId;
use levee_proto::WireError;
use levee_proto::v1::queues_client::QueuesClient;
use levee_proto::v1::subscribe_many_request::Kind;
use levee_proto::v1::{
    AddMailboxes, Credit, ErrorCode, MailboxAck, MailboxAcks, MailboxDelivery, RemoveMailboxes,
    SubscribeManyRequest, SubscribeManyResponse, SubscribeManyStart,
};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::queue::credit::{ROUND_BYTES_MAX, ROUND_MESSAGES_MAX, StreamCredit};
use crate::queue::invalid;
use crate::queue::mailbox::many::{ACKS_MAX, ADD_MAX, ManyContext, ManySession, check_add};
use crate::queue::replicated::{Replication, forward_failed, forwarded};
use crate::queue::stream::{Incoming, Outgoing};

/// Requests queued for one part.
const PART_REQUESTS_QUEUED_MAX: usize = 64;
/// Parts' answers queued for the session.
const ANSWERS_QUEUED_MAX: usize = 64;
/// Ack batches awaiting their parts' confirmations; further client messages wait
/// (back-pressure).
const ACK_BATCHES_WAITING_MAX: usize = 64;
/// How long a stream ending on a refused ack waits for the acks before it to be confirmed.
const ENDING_WAIT_MAX: Duration = Duration::from_secs(5);

/// Where a part is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Target {
    /// By a session on this node.
    Here,
    /// By a stream to this node.
    Node(NodeId),
}

/// One part of the stream: the mailboxes of the shards one node serves.
#[derive(Debug)]
struct Part {
    target: Target,
    requests: mpsc::Sender<SubscribeManyRequest>,
    /// The client's number of each of the part's live mailboxes, by the part's number.
    numbers: HashMap<u32, u32, foldhash::fast::RandomState>,
    /// The number the part gives its next mailbox.
    next_number: u32,
    /// Mailbox numbers below this one the part registered.
    added: u64,
    /// Its request queue closed (it ended): its answers say why.
    closed: bool,
    /// The last ack batch sequence sent to the part, and the last one it confirmed.
    acks_sent: u64,
    acks_confirmed: u64,
    /// Requests waiting for room in `requests`, in order.
    outbox: VecDeque<SubscribeManyRequest>,
    /// Credit of deliveries handed on to the client, not given back to the part yet.
    owed: Credit,
}

/// One of the client's live mailboxes.
#[derive(Debug)]
struct Slot {
    queue: Box<[u8]>,
    part: usize,
    /// Its number in its part.
    number: u32,
    /// The offset after the last one handed on to the client.
    handed_on: Option<u64>,
    /// The offset of the first delivery its part sent here.
    first_received: Option<u64>,
}

/// An answer due to the client once each part named has confirmed up to its mark.
#[derive(Debug)]
struct Due<T> {
    answer: T,
    needs: Vec<(usize, u64)>,
}

/// What the session waited for.
enum Event {
    Closing,
    Answer(usize, Result<Option<SubscribeManyResponse>, WireError>),
    Message(Option<SubscribeManyRequest>),
    Room(usize, mpsc::OwnedPermit<SubscribeManyRequest>),
    Closed(usize),
    EndingWaitOver,
}

/// One `SubscribeMany` stream served in parts (see the module text).
#[derive(Debug)]
pub struct SpreadSession {
    context: ManyContext,
    replication: Replication,
    start: SubscribeManyStart,
    incoming: Incoming<SubscribeManyRequest>,
    outgoing: Outgoing<SubscribeManyResponse>,
    parts: Vec<Part>,
    answers: mpsc::Receiver<(usize, Result<Option<SubscribeManyResponse>, WireError>)>,
    answering: mpsc::Sender<(usize, Result<Option<SubscribeManyResponse>, WireError>)>,
    /// The client's live mailboxes, by number.
    slots: HashMap<u32, Slot, foldhash::fast::RandomState>,
    /// The number the next added queue gets.
    next_number: u32,
    /// Mailbox numbers below this one were answered as added.
    added_answered: u32,
    /// The live mailboxes' queues and numbers.
    names: HashMap<Box<[u8]>, u32, foldhash::fast::RandomState>,
    credit: StreamCredit,
    /// Deliveries (numbered as the client knows them) waiting for the client's credit, with
    /// their parts.
    waiting: VecDeque<(usize, MailboxDelivery)>,
    /// Deliveries of mailboxes whose add is not answered yet, in order.
    early: VecDeque<(usize, MailboxDelivery)>,
    adds: VecDeque<Due<u32>>,
    acks: VecDeque<Due<Option<u64>>>,
    /// How the stream ends once the ack batches sent are confirmed (or [`ENDING_WAIT_MAX`]
    /// passed): with a refused ack's error, or cleanly (the client ended its side).
    ending: Option<(Option<WireError>, tokio::time::Instant)>,
    /// Parts opened on other nodes (`levee_queue_mailbox_parts_elsewhere_total`).
    parts_elsewhere: Counter,
}

impl SpreadSession {
    /// A session for a checked `start`, its parts served here through `context` and elsewhere
    /// where `replication` places their shards.
    pub fn new(
        (context, replication, parts_elsewhere): (ManyContext, Replication, Counter),
        start: SubscribeManyStart,
        incoming: Incoming<SubscribeManyRequest>,
        outgoing: Outgoing<SubscribeManyResponse>,
    ) -> Self {
        let (answering, answers) = mpsc::channel(ANSWERS_QUEUED_MAX);
        Self {
            credit: StreamCredit::initial(start.credit),
            context,
            replication,
            start,
            incoming,
            outgoing,
            parts: Vec::new(),
            answers,
            answering,
            slots: HashMap::default(),
            next_number: 0,
            added_answered: 0,
            names: HashMap::default(),
            waiting: VecDeque::new(),
            early: VecDeque::new(),
            adds: VecDeque::new(),
            acks: VecDeque::new(),
            ending: None,
            parts_elsewhere,
        }
    }

    /// Runs the stream until the client leaves, a part ends or the client breaks the protocol;
    /// the parts end with it.
    pub async fn run(mut self) {
        if let Err(error) = self.serve().await {
            self.outgoing.fail(error).await;
        }
    }

    async fn serve(&mut self) -> Result<(), WireError> {
        let mut closing = self.context.closing.clone();
        loop {
            self.give_credit_back();
            self.answer_due().await;
            if self.ending.is_some() && self.acks.is_empty() {
                return match self.ending.take() {
                    Some((Some(error), _)) => Err(error),
                    _ => Ok(()),
                };
            }
            if !self.hand_on().await {
                return Ok(());
            }
            let blocked = self
                .parts
                .iter()
                .position(|part| !part.closed && !part.outbox.is_empty())
                .map(|index| (index, self.parts[index].requests.clone()));
            let reading = blocked.is_none()
                && self.ending.is_none()
                && self.acks.len() < ACK_BATCHES_WAITING_MAX;
            let ending_at = self.ending.as_ref().map(|(_, at)| *at);
            // Client messages first (as a single node does), so acks and credits are not
            // starved by a long run of deliveries.
            let event = tokio::select! {
                biased;
                _ = closing.wait_for(|closing| *closing) => Event::Closing,
                message = self.incoming.message(), if reading => Event::Message(message?),
                answer = self.answers.recv() => match answer {
                    Some((part, answer)) => Event::Answer(part, answer),
                    None => Event::Closing,
                },
                permit = async {
                    match &blocked {
                        Some((index, sender)) => (*index, sender.clone().reserve_owned().await),
                        None => std::future::pending().await,
                    }
                }, if blocked.is_some() => match permit {
                    (index, Ok(permit)) => Event::Room(index, permit),
                    (index, Err(_)) => Event::Closed(index),
                },
                () = async {
                    match ending_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                }, if ending_at.is_some() => Event::EndingWaitOver,
            };
            match event {
                Event::Closing => {
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        "server shutting down; subscribe again, to this server once it is back \
                         or to another",
                    ));
                }
                Event::Answer(part, answer) => self.answered(part, answer)?,
                Event::Room(part, permit) => {
                    if let Some(request) = self.parts[part].outbox.pop_front() {
                        permit.send(request);
                    }
                }
                Event::Closed(part) => {
                    // It ended: its last answer (its error, or its end) says why.
                    let mine = &mut self.parts[part];
                    mine.closed = true;
                    mine.outbox.clear();
                }
                Event::Message(Some(message)) => self.handle(message).await?,
                Event::Message(None) => {
                    // The ack batches sent are written and answered before the stream ends.
                    self.ending = Some((None, tokio::time::Instant::now() + ENDING_WAIT_MAX));
                }
                Event::EndingWaitOver => {
                    return match self.ending.take() {
                        Some((Some(error), _)) => Err(error),
                        _ => Ok(()),
                    };
                }
            }
        }
    }

    /// Applies one client message.
    async fn handle(&mut self, message: SubscribeManyRequest) -> Result<(), WireError> {
        match message.kind {
            Some(Kind::Add(add)) => self.add(add).await,
            Some(Kind::Remove(RemoveMailboxes { mailboxes })) => self.remove(&mailboxes),
            Some(Kind::Credit(credit)) => {
                self.credit.grant(credit);
                Ok(())
            }
            Some(Kind::Ack(acks)) => self.ack(acks),
            Some(Kind::Start(_)) | None => Err(invalid(
                "a SubscribeMany stream takes one start message".to_owned(),
            )),
        }
    }

    /// Checks an add as a single node does, sends each queue to the part that serves its
    /// shard (opening the part on first use), and records the answer due once they all
    /// registered their share.
    async fn add(&mut self, AddMailboxes { queues }: AddMailboxes) -> Result<(), WireError> {
        let live = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
        let first = self.next_number;
        let count = check_add(&queues, live, first)?;
        let mut seen: HashMap<&[u8], usize, foldhash::fast::RandomState> = HashMap::default();
        for (index, queue) in queues.iter().enumerate() {
            let taken = self.names.get(&queue[..]).copied().or_else(|| {
                seen.get(&queue[..])
                    .map(|earlier| first + u32::try_from(*earlier).unwrap_or(u32::MAX))
            });
            if let Some(taken) = taken {
                return Err(invalid(format!(
                    "queues[{index}] ('{}') is already mailbox {taken} on this stream; add a \
                     queue once",
                    String::from_utf8_lossy(queue)
                )));
            }
            seen.insert(queue, index);
        }
        let mut shares: Vec<Vec<Vec<u8>>> = vec![Vec::new(); self.parts.len()];
        for (queue, number) in queues.into_iter().zip(first..) {
            let part = self.part_for(&queue).await?;
            if shares.len() <= part {
                shares.resize(part + 1, Vec::new());
            }
            let mine = &mut self.parts[part];
            let part_number = mine.next_number;
            mine.next_number += 1;
            self.slots.insert(
                number,
                Slot {
                    queue: queue.clone().into_boxed_slice(),
                    part,
                    number: part_number,
                    handed_on: None,
                    first_received: None,
                },
            );
            mine.numbers.insert(part_number, number);
            self.names.insert(queue.clone().into_boxed_slice(), number);
            shares[part].push(queue);
        }
        self.next_number = first + count;
        let mut needs = Vec::new();
        for (part, queues) in shares.into_iter().enumerate() {
            if queues.is_empty() {
                continue;
            }
            let mine = &mut self.parts[part];
            needs.push((part, u64::from(mine.next_number)));
            mine.outbox.push_back(SubscribeManyRequest {
                kind: Some(Kind::Add(AddMailboxes { queues })),
            });
        }
        self.adds.push_back(Due {
            answer: first + count,
            needs,
        });
        Ok(())
    }

    /// The part that serves `queue`'s shard, opened if it is the first queue for its node.
    async fn part_for(&mut self, queue: &[u8]) -> Result<usize, WireError> {
        let elsewhere = self.replication.read_elsewhere(queue, false)?;
        let target = elsewhere
            .as_ref()
            .map_or(Target::Here, |(node, _)| Target::Node(*node));
        if let Some(index) = self.parts.iter().position(|part| part.target == target) {
            return Ok(index);
        }
        let index = self.parts.len();
        let (requests, received) = mpsc::channel(PART_REQUESTS_QUEUED_MAX);
        let answering = self.answering.clone();
        match elsewhere {
            None => {
                let incoming = Incoming::new(ReceiverStream::new(received).map(Ok));
                let (outgoing, mut responses) = crate::queue::stream::channel();
                let session =
                    ManySession::new(self.context.clone(), &self.start, incoming, outgoing);
                tokio::spawn(session.run());
                tokio::spawn(async move {
                    while let Some(response) = responses.next().await {
                        let failed = response.is_err();
                        if answering.send((index, response.map(Some))).await.is_err() || failed {
                            return;
                        }
                    }
                    let _ = answering.send((index, Ok(None))).await;
                });
            }
            Some((node, channel)) => {
                let start = SubscribeManyRequest {
                    kind: Some(Kind::Start(self.start.clone())),
                };
                let _ = requests.try_send(start);
                let mut responses = QueuesClient::new(channel)
                    .max_decoding_message_size(usize::MAX)
                    .subscribe_many(forwarded(ReceiverStream::new(received)))
                    .await
                    .map_err(|status| WireError::from_status(&forward_failed(node, status)))?
                    .into_inner();
                self.parts_elsewhere.inc();
                tokio::spawn(async move {
                    loop {
                        let answer = match responses.next().await {
                            Some(Ok(response)) => Ok(Some(response)),
                            Some(Err(status)) => {
                                Err(WireError::from_transport(&forward_failed(node, status)))
                            }
                            None => Ok(None),
                        };
                        let last = !matches!(answer, Ok(Some(_)));
                        if answering.send((index, answer)).await.is_err() || last {
                            return;
                        }
                    }
                });
            }
        }
        self.parts.push(Part {
            target,
            requests,
            numbers: HashMap::default(),
            next_number: 0,
            added: 0,
            closed: false,
            acks_sent: 0,
            acks_confirmed: 0,
            outbox: VecDeque::new(),
            owed: Credit::default(),
        });
        Ok(index)
    }

    /// Drops mailboxes (unknown or removed numbers are ignored): their parts stop delivering
    /// them, and their deliveries waiting here are dropped.
    fn remove(&mut self, numbers: &[u32]) -> Result<(), WireError> {
        if numbers.len() > ADD_MAX {
            return Err(invalid(format!(
                "a remove names at most {ADD_MAX} mailboxes, got {}",
                numbers.len()
            )));
        }
        let mut shares: Vec<Vec<u32>> = vec![Vec::new(); self.parts.len()];
        for number in numbers {
            let Some(slot) = self.slots.remove(number) else {
                continue;
            };
            self.names.remove(&slot.queue);
            self.parts[slot.part].numbers.remove(&slot.number);
            shares[slot.part].push(slot.number);
        }
        for (part, mailboxes) in shares.into_iter().enumerate() {
            if !mailboxes.is_empty() {
                self.parts[part].outbox.push_back(SubscribeManyRequest {
                    kind: Some(Kind::Remove(RemoveMailboxes { mailboxes })),
                });
            }
        }
        Ok(())
    }

    /// Checks an ack batch as a single node does and sends each part its share; the batch is
    /// answered once every part confirmed it. A refused ack ends the stream after the acks
    /// before it are confirmed.
    fn ack(&mut self, MailboxAcks { acks, sequence }: MailboxAcks) -> Result<(), WireError> {
        if acks.len() > ACKS_MAX {
            return Err(invalid(format!(
                "an ack batch holds at most {ACKS_MAX} acks, got {}",
                acks.len()
            )));
        }
        let mut shares: Vec<Vec<MailboxAck>> = vec![Vec::new(); self.parts.len()];
        let mut refused = None;
        for ack in acks {
            let Some(slot) = self.slots.get(&ack.mailbox) else {
                if ack.mailbox < self.next_number {
                    // Removed since: its ack no longer matters to this stream.
                    continue;
                }
                refused = Some(invalid(format!(
                    "ack of mailbox {} which was never added (mailboxes 0 to {} exist)",
                    ack.mailbox,
                    i64::from(self.next_number) - 1
                )));
                break;
            };
            // Past what was handed on to the client (or, before that, at or past the first
            // message its part sent here): refused, as a single node does. With nothing from
            // the part yet, the part judges it against what it delivered.
            if let Some(next) = slot.handed_on.or(slot.first_received)
                && ack.offset >= next
            {
                refused = Some(super::ack_past_delivered(
                    &format!("mailbox {}", ack.mailbox),
                    ack.offset,
                    next,
                ));
                break;
            }
            shares[slot.part].push(MailboxAck {
                mailbox: slot.number,
                offset: ack.offset,
            });
        }
        let mut needs = Vec::new();
        for (part, acks) in shares.into_iter().enumerate() {
            if acks.is_empty() {
                continue;
            }
            let mine = &mut self.parts[part];
            mine.acks_sent += 1;
            needs.push((part, mine.acks_sent));
            mine.outbox.push_back(SubscribeManyRequest {
                kind: Some(Kind::Ack(MailboxAcks {
                    acks,
                    sequence: mine.acks_sent,
                })),
            });
        }
        self.acks.push_back(Due {
            answer: refused.is_none().then_some(sequence),
            needs,
        });
        if let Some(error) = refused {
            self.ending = Some((Some(error), tokio::time::Instant::now() + ENDING_WAIT_MAX));
        }
        Ok(())
    }

    /// Takes one part's answer: its deliveries wait for the client's credit, its
    /// registrations and confirmations answer what they complete. A part that ended ends the
    /// stream.
    fn answered(
        &mut self,
        part: usize,
        answer: Result<Option<SubscribeManyResponse>, WireError>,
    ) -> Result<(), WireError> {
        let Some(response) = answer.map_err(|mut error| {
            if let Target::Node(node) = self.parts[part].target {
                error.message = format!(
                    "{} (node {node} served this stream's mailboxes of the shards it holds)",
                    error.message
                );
            }
            error
        })?
        else {
            return Err(WireError::new(
                ErrorCode::Unavailable,
                match self.parts[part].target {
                    Target::Here => {
                        "this node ended its part of the stream; subscribe again".to_owned()
                    }
                    Target::Node(node) => format!(
                        "node {node}, which served this stream's mailboxes of the shards it \
                         holds, ended its part; subscribe again"
                    ),
                },
            ));
        };
        for mut delivery in response.deliveries {
            let Some(number) = self.parts[part].numbers.get(&delivery.mailbox).copied() else {
                // Removed since (or never given: a part's mistake, dropped likewise).
                give_back(&mut self.parts[part].owed, &delivery);
                continue;
            };
            delivery.mailbox = number;
            if let Some(slot) = self.slots.get_mut(&number) {
                slot.first_received.get_or_insert(delivery.offset);
            }
            if number < self.added_answered {
                self.waiting.push_back((part, delivery));
            } else {
                self.early.push_back((part, delivery));
            }
        }
        let mine = &mut self.parts[part];
        mine.added = mine.added.max(u64::from(response.mailboxes_added));
        mine.acks_confirmed = mine.acks_confirmed.max(response.acked_sequence);
        Ok(())
    }

    /// Answers the adds and ack batches every part of which is done, in the client's order.
    async fn answer_due(&mut self) {
        let added = pop_due(&mut self.adds, &self.parts, |part| part.added);
        if let Some(added) = added.last() {
            let answer = SubscribeManyResponse {
                mailboxes_added: *added,
                ..SubscribeManyResponse::default()
            };
            let _ = self.outgoing.send(answer).await;
            // Their deliveries go after the answer, in the order they came.
            self.added_answered = *added;
            let (answered, still_early): (VecDeque<_>, VecDeque<_>) =
                std::mem::take(&mut self.early)
                    .into_iter()
                    .partition(|(_, delivery)| delivery.mailbox < self.added_answered);
            self.waiting.extend(answered);
            self.early = still_early;
        }
        let acked = pop_due(&mut self.acks, &self.parts, |part| part.acks_confirmed);
        // A refused batch is not answered: the stream ends with its error.
        if let Some(sequence) = acked.into_iter().flatten().last() {
            let answer = SubscribeManyResponse {
                acked_sequence: sequence,
                ..SubscribeManyResponse::default()
            };
            let _ = self.outgoing.send(answer).await;
        }
    }

    /// Hands waiting deliveries on to the client within its credit, a response of up to a
    /// round's bounds at a time; false once the client is gone.
    async fn hand_on(&mut self) -> bool {
        while self.credit.is_open() && !self.waiting.is_empty() {
            let mut deliveries = Vec::new();
            let mut bytes = 0_u32;
            while self.credit.is_open()
                && deliveries.len() < ROUND_MESSAGES_MAX as usize
                && bytes < ROUND_BYTES_MAX
            {
                let Some((part, delivery)) = self.waiting.pop_front() else {
                    break;
                };
                give_back(&mut self.parts[part].owed, &delivery);
                let Some(slot) = self.slots.get_mut(&delivery.mailbox) else {
                    // Removed since.
                    continue;
                };
                slot.handed_on = Some(delivery.offset + 1);
                let len = delivery.payload.len();
                self.credit.spend(1, len);
                bytes = bytes.saturating_add(u32::try_from(len).unwrap_or(u32::MAX));
                deliveries.push(delivery);
            }
            if deliveries.is_empty() {
                continue;
            }
            let response = SubscribeManyResponse {
                deliveries,
                ..SubscribeManyResponse::default()
            };
            if !self.outgoing.send(response).await {
                return false;
            }
        }
        true
    }

    /// Gives each part the credit of its deliveries handed on since the last time, behind
    /// the requests it has waiting (once there is room).
    fn give_credit_back(&mut self) {
        for part in &mut self.parts {
            if part.owed.messages > 0 && part.outbox.is_empty() && !part.closed {
                let credit = std::mem::take(&mut part.owed);
                let request = SubscribeManyRequest {
                    kind: Some(Kind::Credit(credit)),
                };
                if let Err(mpsc::error::TrySendError::Full(request)) =
                    part.requests.try_send(request)
                {
                    // Sent once there is room (the session waits for it).
                    part.outbox.push_back(request);
                }
            }
        }
    }
}

/// Adds what `delivery` took of its part's credit to what the part is owed.
fn give_back(owed: &mut Credit, delivery: &MailboxDelivery) {
    owed.messages = owed.messages.saturating_add(1);
    owed.bytes = owed
        .bytes
        .saturating_add(u32::try_from(delivery.payload.len()).unwrap_or(u32::MAX));
}

/// Pops the answers at the front of `due` whose parts all reached their marks (`reached` of
/// each part), in order.
fn pop_due<T>(
    due: &mut VecDeque<Due<T>>,
    parts: &[Part],
    reached: impl Fn(&Part) -> u64,
) -> Vec<T> {
    let mut popped = Vec::new();
    while let Some(front) = due.front() {
        if !front
            .needs
            .iter()
            .all(|(part, mark)| reached(&parts[*part]) >= *mark)
        {
            break;
        }
        popped.extend(due.pop_front().map(|front| front.answer));
    }
    popped
}
