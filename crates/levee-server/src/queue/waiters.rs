//! [`Waiters`]: who waits on which queue, shared by every kind of session (single-queue
//! subscriptions, many-queue mailbox streams, topic consumers). Appends wake the sessions of
//! the queues they grew, so nothing polls; many-queue streams get the appended messages
//! themselves as hints ([`Inbox`]). Deletes and subscriptions exclude each other here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use tokio::sync::Notify;

use crate::queue::credit::SUBSCRIPTIONS_MAX;
use crate::queue::lock;

/// Longest pause between two looks of [`Waiters::wait_out_deletes`].
const DELETE_WAIT_PAUSE_MAX: std::time::Duration = std::time::Duration::from_millis(50);

/// Who waits on which queue: appends wake the subscriptions of the queues they grew, single
/// ones ([`Subscribe`], topic members) through a shared [`Notify`], many-queue streams through
/// their [`Inbox`] with the mailbox number.
///
/// [`Subscribe`]: levee_proto::v1::queues_server::Queues::subscribe
#[derive(Debug)]
pub struct Waiters {
    queues: Mutex<WaiterMap>,
    /// Deletes applied from shards' logs so far ([`Waiters::note_deleted`]).
    deletes: std::sync::atomic::AtomicU64,
    /// The last [`RECENT_DELETES_MAX`] of them: each one's number and queue.
    recent_deletes: Mutex<std::collections::VecDeque<(u64, Box<[u8]>)>>,
    /// Times this node stopped holding a replica of some shard ([`Waiters::note_shards_moved`]).
    shards_moved: std::sync::atomic::AtomicU64,
}

/// Replicated deletes remembered for the streams that have not looked at them yet; a stream
/// that falls further behind ends (see [`Waiters::deleted_since`]).
pub const RECENT_DELETES_MAX: usize = 1_024;

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
            deletes: std::sync::atomic::AtomicU64::new(0),
            recent_deletes: Mutex::new(std::collections::VecDeque::new()),
            shards_moved: std::sync::atomic::AtomicU64::new(0),
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

    /// How many deletes applied from shards' logs this node has seen (a stream notes it
    /// before reading its positions, and looks at [`Waiters::deleted_since`] when it moves).
    pub fn deletes_seen(&self) -> u64 {
        self.deletes.load(std::sync::atomic::Ordering::Acquire)
    }

    /// `queue` was deleted by a shard's log (a replicated delete, taken by any node, so no
    /// subscription of it here could refuse it): streams of it here learn it through
    /// [`Waiters::deleted_since`] and are woken to look.
    pub fn note_deleted(&self, queue: &[u8]) {
        {
            let mut recent = lock(&self.recent_deletes);
            let number = self.deletes_seen() + 1;
            recent.push_back((number, queue.into()));
            if recent.len() > RECENT_DELETES_MAX {
                recent.pop_front();
            }
            self.deletes
                .store(number, std::sync::atomic::Ordering::Release);
        }
        self.wake(queue);
    }

    /// The queues deleted by shards' logs after the first `seen` deletes (see
    /// [`Waiters::deletes_seen`]), and how many deletes that makes; `None` when some of them
    /// are no longer remembered.
    pub fn deleted_since(&self, seen: u64) -> Option<(Vec<Box<[u8]>>, u64)> {
        let recent = lock(&self.recent_deletes);
        let now = self.deletes_seen();
        if now == seen {
            return Some((Vec::new(), now));
        }
        let oldest = recent.front().map_or(now + 1, |(number, _)| *number);
        if oldest > seen + 1 {
            return None;
        }
        let queues = recent
            .iter()
            .filter(|(number, _)| *number > seen)
            .map(|(_, queue)| queue.clone())
            .collect();
        Some((queues, now))
    }

    /// How many times this node stopped holding a replica of some shard (a stream notes it
    /// before it checks that its queues' shards are held here, and checks again when it moves).
    pub fn shards_moved(&self) -> u64 {
        self.shards_moved.load(std::sync::atomic::Ordering::Acquire)
    }

    /// This node stopped holding a replica of some shard (the placement moved it to another
    /// node): every stream is woken to check that its queues' shards are still held here.
    pub fn note_shards_moved(&self) {
        self.shards_moved
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.wake_every();
    }

    /// The mailbox numbers of `inbox` registered on `queue`.
    pub fn mailboxes_of(&self, inbox: &Arc<Inbox>, queue: &[u8]) -> Vec<u32> {
        let weak = Arc::downgrade(inbox);
        lock(&self.queues)
            .entries
            .get(queue)
            .map(|watchers| {
                watchers
                    .inboxes
                    .iter()
                    .filter(|(other, _)| Weak::ptr_eq(other, &weak))
                    .map(|(_, number)| *number)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Wakes every subscription (a snapshot replaced a shard's queues under them).
    pub fn wake_every(&self) {
        let queues: Vec<Box<[u8]>> = lock(&self.queues).entries.keys().cloned().collect();
        let queues: Vec<&[u8]> = queues.iter().map(|queue| &queue[..]).collect();
        self.wake_all(&queues);
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
    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.queues).entries.len()
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
}
