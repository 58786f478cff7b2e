//! Delayed delivery: where a message that must wait waits, and when it is due. Each waiting
//! message is a [`DelayedEntry`] in a store queue of its *slot*, a span of due times:
//!
//! - a **fine** slot spans [`FINE_MS`] and holds messages due within [`HORIZON_MS`] of when
//!   they were placed; it is delivered whole once its span has passed, so a message is never
//!   delivered before its time and at most [`FINE_MS`] (plus the runtime's tick) after it;
//! - a **coarse** slot spans [`COARSE_MS`] and holds messages due later; [`SPREAD_AHEAD_MS`]
//!   before its span starts, its messages are placed again, now into fine slots.
//!
//! So the slots that exist at once are bounded by the horizon over the fine span plus the
//! longest delay over the coarse span (12,000 + 60,480), however many messages wait, and the
//! runtime keeps in memory only a count per slot ([`DelayWheel`]). The wheel is pure: it takes
//! the time as an argument, and every placement after a slot was taken goes elsewhere, so a
//! slot being delivered never gains an entry.

use std::collections::BTreeMap;

use crate::names::DELAY_PREFIX;

/// Span of a fine slot, ms.
pub const FINE_MS: u64 = 10;
/// Span of a coarse slot, ms.
pub const COARSE_MS: u64 = 10_000;
/// Messages due within this many ms of their placement go straight to a fine slot.
pub const HORIZON_MS: u64 = 120_000;
/// A coarse slot is spread into fine slots this many ms before its span starts.
pub const SPREAD_AHEAD_MS: u64 = 30_000;
const _: () = assert!(
    SPREAD_AHEAD_MS + COARSE_MS < HORIZON_MS,
    "a spread coarse slot's messages all fall within the fine horizon"
);

/// A slot: its level and number (its span starts at number x span).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Slot {
    /// A fine slot: due times from n x [`FINE_MS`] up to (n + 1) x [`FINE_MS`].
    Fine(u64),
    /// A coarse slot: due times from n x [`COARSE_MS`] up to (n + 1) x [`COARSE_MS`].
    Coarse(u64),
}

impl Slot {
    /// The slot's store queue: [`DELAY_PREFIX`], `f` or `c`, the number in 16 hex digits.
    pub fn queue(self) -> Vec<u8> {
        let (level, number) = match self {
            Self::Fine(number) => ('f', number),
            Self::Coarse(number) => ('c', number),
        };
        let mut name = DELAY_PREFIX.to_vec();
        name.extend_from_slice(format!("{level}{number:016x}").as_bytes());
        name
    }

    /// The slot's store queue in shard `shard` of a cluster that replicates its queues:
    /// [`DELAY_PREFIX`], `s`, the shard in 8 hex digits, then as [`Slot::queue`] (each shard
    /// keeps its own slots; [`Slot::parse`] does not take these).
    pub fn shard_queue(self, shard: u32) -> Vec<u8> {
        let mut name = shard_slots_prefix(shard);
        name.extend_from_slice(&self.queue()[DELAY_PREFIX.len()..]);
        name
    }

    /// The slot a shard's slot queue name is the queue of (see [`Slot::shard_queue`]).
    pub fn parse_shard(queue: &[u8], shard: u32) -> Option<Self> {
        let rest = queue.strip_prefix(&shard_slots_prefix(shard)[..])?;
        Self::parse_level(rest)
    }

    /// The slot a queue name is the queue of, if it is one.
    pub fn parse(queue: &[u8]) -> Option<Self> {
        Self::parse_level(queue.strip_prefix(DELAY_PREFIX)?)
    }

    /// A slot from its level letter and 16 hex digits.
    fn parse_level(rest: &[u8]) -> Option<Self> {
        let (&level, hex) = rest.split_first()?;
        if hex.len() != 16 {
            return None;
        }
        let number = u64::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
        match level {
            b'f' => Some(Self::Fine(number)),
            b'c' => Some(Self::Coarse(number)),
            _ => None,
        }
    }
}

/// The prefix of every slot queue of shard `shard` (see [`Slot::shard_queue`]).
pub fn shard_slots_prefix(shard: u32) -> Vec<u8> {
    let mut name = DELAY_PREFIX.to_vec();
    name.extend_from_slice(format!("s{shard:08x}").as_bytes());
    name
}

/// Where a message that must wait until `due_ms` goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// It is due (or its slot is being delivered): deliver it now.
    Now,
    /// Append it to this slot's queue.
    Slot(Slot),
}

/// What a tick must do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Due {
    /// Coarse slots to spread: read, place every entry again, delete.
    pub spread: Vec<u64>,
    /// Fine slots to deliver: read, deliver every entry, delete.
    pub deliver: Vec<u64>,
}

impl Due {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.spread.is_empty() && self.deliver.is_empty()
    }
}

/// The slots that hold entries, with their counts; see the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DelayWheel {
    fine: BTreeMap<u64, u64>,
    coarse: BTreeMap<u64, u64>,
    /// Fine slots below this were taken for delivery.
    fine_taken_below: u64,
    /// Coarse slots below this were taken for spreading.
    coarse_taken_below: u64,
    pending: u64,
}

impl DelayWheel {
    /// Where one message due at `due_ms` goes at `now_ms`; counts it in its slot.
    pub fn place(&mut self, due_ms: u64, now_ms: u64) -> Placement {
        let fine = due_ms / FINE_MS;
        if due_ms <= now_ms || fine < self.fine_taken_below {
            return Placement::Now;
        }
        let coarse = due_ms / COARSE_MS;
        let slot = if due_ms < now_ms.saturating_add(HORIZON_MS) || coarse < self.coarse_taken_below
        {
            *self.fine.entry(fine).or_default() += 1;
            Slot::Fine(fine)
        } else {
            *self.coarse.entry(coarse).or_default() += 1;
            Slot::Coarse(coarse)
        };
        self.pending += 1;
        Placement::Slot(slot)
    }

    /// Counts `entries` found in `slot` (at start, from the store).
    pub fn restore(&mut self, slot: Slot, entries: u64) {
        let counts = match slot {
            Slot::Fine(number) => self.fine.entry(number).or_default(),
            Slot::Coarse(number) => self.coarse.entry(number).or_default(),
        };
        *counts += entries;
        self.pending += entries;
    }

    /// Takes the slots due at `now_ms`: coarse ones whose span starts within
    /// [`SPREAD_AHEAD_MS`], fine ones whose span has passed. No later placement goes to them.
    pub fn take_due(&mut self, now_ms: u64) -> Due {
        Due {
            spread: self.take_spread(now_ms),
            deliver: self.take_deliver(now_ms),
        }
    }

    /// Takes the coarse slots whose span starts within [`SPREAD_AHEAD_MS`] of `now_ms`.
    pub fn take_spread(&mut self, now_ms: u64) -> Vec<u64> {
        let spread_below = now_ms.saturating_add(SPREAD_AHEAD_MS) / COARSE_MS + 1;
        self.coarse_taken_below = self.coarse_taken_below.max(spread_below);
        let kept = self.coarse.split_off(&self.coarse_taken_below);
        let taken = std::mem::replace(&mut self.coarse, kept);
        self.pending = self.pending.saturating_sub(taken.values().sum());
        taken.into_keys().collect()
    }

    /// Takes the fine slots whose span has passed at `now_ms`.
    pub fn take_deliver(&mut self, now_ms: u64) -> Vec<u64> {
        self.fine_taken_below = self.fine_taken_below.max(now_ms / FINE_MS);
        let kept = self.fine.split_off(&self.fine_taken_below);
        let taken = std::mem::replace(&mut self.fine, kept);
        self.pending = self.pending.saturating_sub(taken.values().sum());
        taken.into_keys().collect()
    }

    /// A wheel that took the fine slots below `fine` and the coarse slots below `coarse`
    /// (see [`DelayWheel::taken_below`]), holding nothing yet.
    pub fn taken(fine: u64, coarse: u64) -> Self {
        Self {
            fine_taken_below: fine,
            coarse_taken_below: coarse,
            ..Self::default()
        }
    }

    /// The fine and coarse slot numbers below which slots were taken: no placement goes to
    /// them any more. Two wheels with the same marks place every message alike.
    pub fn taken_below(&self) -> (u64, u64) {
        (self.fine_taken_below, self.coarse_taken_below)
    }

    /// The earliest time (ms since the Unix epoch) at which [`DelayWheel::take_due`] takes a
    /// slot holding messages, if one does: a fine slot once its span has passed, a coarse one
    /// [`SPREAD_AHEAD_MS`] before its span starts.
    pub fn next_due_ms(&self) -> Option<u64> {
        let fine = self
            .fine
            .keys()
            .next()
            .map(|&number| number.saturating_add(1).saturating_mul(FINE_MS));
        let coarse = self.coarse.keys().next().map(|&number| {
            number
                .saturating_mul(COARSE_MS)
                .saturating_sub(SPREAD_AHEAD_MS)
        });
        fine.into_iter().chain(coarse).min()
    }

    /// Messages waiting in slots not yet taken.
    pub fn pending(&self) -> u64 {
        self.pending
    }

    /// Slots holding messages (a bound the module docs give).
    pub fn slots(&self) -> usize {
        self.fine.len() + self.coarse.len()
    }
}

/// One waiting message as its slot's queue holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DelayedEntry {
    /// When it is due, ms since the Unix epoch.
    pub due_ms: u64,
    /// The topic whose consumers to wake when it is delivered.
    pub topic: String,
    /// The queue it is appended to when due (a partition, or a group's retry queue).
    pub target: Vec<u8>,
    /// What is appended.
    pub body: Vec<u8>,
}

/// A length as two little-endian bytes (topic and queue names are at most 255 bytes).
fn length_u16(length: usize) -> [u8; 2] {
    u16::try_from(length).unwrap_or(u16::MAX).to_le_bytes()
}

/// Version byte of [`DelayedEntry`]'s layout.
const ENTRY_VERSION: u8 = 1;

impl DelayedEntry {
    /// The entry's bytes: version, due time, topic length and topic, target length and
    /// target, body (docs/FORMAT.md).
    pub fn encode(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(13 + self.topic.len() + self.target.len() + self.body.len());
        out.push(ENTRY_VERSION);
        out.extend_from_slice(&self.due_ms.to_le_bytes());
        out.extend_from_slice(&length_u16(self.topic.len()));
        out.extend_from_slice(self.topic.as_bytes());
        out.extend_from_slice(&length_u16(self.target.len()));
        out.extend_from_slice(&self.target);
        out.extend_from_slice(&self.body);
        out
    }

    /// An entry from its bytes; `None` if they are not one.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != ENTRY_VERSION {
            return None;
        }
        let (due, rest) = rest.split_at_checked(8)?;
        let due_ms = u64::from_le_bytes(due.try_into().ok()?);
        let (length, rest) = rest.split_at_checked(2)?;
        let (topic, rest) =
            rest.split_at_checked(usize::from(u16::from_le_bytes(length.try_into().ok()?)))?;
        let (length, rest) = rest.split_at_checked(2)?;
        let (target, body) =
            rest.split_at_checked(usize::from(u16::from_le_bytes(length.try_into().ok()?)))?;
        Some(Self {
            due_ms,
            topic: std::str::from_utf8(topic).ok()?.to_owned(),
            target: target.to_vec(),
            body: body.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn given_slots_then_their_queue_names_parse_back() {
        for slot in [Slot::Fine(0), Slot::Fine(u64::MAX), Slot::Coarse(12_345)] {
            assert_eq!(Slot::parse(&slot.queue()), Some(slot));
        }
        assert_eq!(Slot::parse(b"\0delay\0x0000000000000001"), None);
        assert_eq!(Slot::parse(b"\0topic\0t\x000"), None);
        let shard = Slot::Coarse(7).shard_queue(3);
        assert_eq!(Slot::parse_shard(&shard, 3), Some(Slot::Coarse(7)));
        assert_eq!(Slot::parse_shard(&shard, 4), None, "another shard's");
        assert_eq!(
            Slot::parse(&shard),
            None,
            "a shard's slot is not a node's own"
        );
    }

    #[test]
    fn given_slots_then_the_next_due_time_is_the_first_a_take_would_take() {
        let mut wheel = DelayWheel::taken(0, 0);
        assert_eq!(wheel.next_due_ms(), None);
        let now = 1_000_000;
        wheel.place(now + HORIZON_MS + COARSE_MS, now);
        let coarse = wheel.next_due_ms().unwrap();
        assert!(wheel.clone().take_due(coarse - 1).spread.is_empty());
        assert_eq!(wheel.clone().take_due(coarse).spread.len(), 1);
        wheel.place(now + 25, now);
        let fine = wheel.next_due_ms().unwrap();
        assert!(wheel.clone().take_due(fine - 1).deliver.is_empty());
        assert_eq!(wheel.clone().take_due(fine).deliver.len(), 1);
        let marks = {
            let mut taken = wheel.clone();
            taken.take_due(fine);
            taken.taken_below()
        };
        let mut again = DelayWheel::taken(marks.0, marks.1);
        assert_eq!(
            again.place(now + 25, now),
            Placement::Now,
            "placed as the taken wheel"
        );
    }

    #[test]
    fn given_entries_then_they_round_trip() {
        let entry = DelayedEntry {
            due_ms: 5,
            topic: "orders".to_owned(),
            target: b"\0topic\0orders\x001".to_vec(),
            body: b"payload".to_vec(),
        };
        assert_eq!(DelayedEntry::decode(&entry.encode()), Some(entry));
        assert_eq!(DelayedEntry::decode(&[1, 0]), None);
    }

    #[test]
    fn given_near_and_far_due_times_then_fine_and_coarse_slots() {
        let mut wheel = DelayWheel::default();
        let now = 1_000_000;
        assert_eq!(wheel.place(now, now), Placement::Now);
        assert_eq!(
            wheel.place(now + 25, now),
            Placement::Slot(Slot::Fine((now + 25) / FINE_MS))
        );
        assert_eq!(
            wheel.place(now + HORIZON_MS + 1, now),
            Placement::Slot(Slot::Coarse((now + HORIZON_MS + 1) / COARSE_MS))
        );
        assert_eq!(wheel.pending(), 2);
        assert!(
            wheel.take_due(now + 25).is_empty(),
            "the fine span has not passed"
        );
        let due = wheel.take_due(now + 30);
        assert_eq!(due.deliver, vec![(now + 25) / FINE_MS]);
        assert_eq!(
            wheel.place(now + 25, now + 20),
            Placement::Now,
            "a taken slot gets nothing more"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// However placements and ticks interleave, a message is delivered no earlier than
        /// its due time and at most a fine span plus the longest time between ticks after it.
        #[test]
        fn never_early_and_late_by_at_most_a_fine_span_and_a_tick_gap(
            placements in proptest::collection::vec((0_u64..200_000, 0_u64..20), 1..60),
            tick_ms in 5_u64..40,
        ) {
            let mut wheel = DelayWheel::default();
            // Slot -> due times waiting in it.
            let mut slots = std::collections::HashMap::<Slot, Vec<u64>>::new();
            let mut now = 7_000_000_u64;
            let mut late_max = 0;
            let mut delivered = 0;
            let mut placed = placements.iter();
            let mut last_tick = now;
            let mut tick_gap_max = 0;
            let deliver = |due: u64, now: u64, late_max: &mut u64| {
                prop_assert!(due <= now, "delivered early: due {} at {}", due, now);
                *late_max = (*late_max).max(now - due);
                Ok(())
            };
            for _ in 0..100_000 {
                if let Some(&(delay, gap)) = placed.next() {
                    now += gap;
                    let due = now + delay;
                    match wheel.place(due, now) {
                        Placement::Now => { deliver(due, now, &mut late_max)?; delivered += 1; }
                        Placement::Slot(slot) => slots.entry(slot).or_default().push(due),
                    }
                }
                now += tick_ms;
                tick_gap_max = tick_gap_max.max(now - last_tick);
                last_tick = now;
                let due = wheel.take_due(now);
                for coarse in due.spread {
                    for entry in slots.remove(&Slot::Coarse(coarse)).unwrap_or_default() {
                        match wheel.place(entry, now) {
                            Placement::Now => { deliver(entry, now, &mut late_max)?; delivered += 1; }
                            Placement::Slot(slot) => {
                                prop_assert!(matches!(slot, Slot::Fine(_)));
                                slots.entry(slot).or_default().push(entry);
                            }
                        }
                    }
                }
                for fine in due.deliver {
                    for entry in slots.remove(&Slot::Fine(fine)).unwrap_or_default() {
                        deliver(entry, now, &mut late_max)?;
                        delivered += 1;
                    }
                }
                if delivered == placements.len() {
                    break;
                }
            }
            prop_assert_eq!(delivered, placements.len());
            prop_assert!(late_max <= FINE_MS + tick_gap_max, "late by {}", late_max);
            prop_assert_eq!(wheel.pending(), 0);
        }
    }
}
