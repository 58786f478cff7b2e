//! The log floor: where recovery's replay of log records may start. Owns the refresh of the
//! buffered list's stale entries (which would hold the floor back), the remembered round
//! starts, the floor written at the head of each new segment (a rotation at the start of a
//! round), and the segment-deletion floor a completed checkpoint allows.

use super::Committer;
use crate::format::LogFloor;
use crate::store::{Listed, lock};
use std::io;

/// Round starts are remembered at most once per this many bytes of a segment (an earlier one
/// stands for the rounds after it, conservatively: see `Committer::floor_for`).
const ROUND_START_SPACING_BYTES: u64 = 1 << 20;

/// Most buffered-list entries one round refreshes (see `Committer::refresh_listed`).
const REFRESH_PER_ROUND_MAX: usize = 1024;

impl Committer<'_> {
    /// Raises stale entries at the front of the buffered list, before round `round`: a queue
    /// stays listed, with the round it was first listed in, while rounds seal its buffer
    /// chunk by chunk (its messages keep coming), so the entry says far older than the
    /// queue's oldest unsealed message (its `unsealed_since`) and would hold the log floor,
    /// and so recovery's replay, back. From the front, at most [`REFRESH_PER_ROUND_MAX`]
    /// entries a round: a stale one goes to the back with its queue's round; one of a queue
    /// with nothing buffered is dropped (and the queue unlisted); one of a deleted queue
    /// moves to `gone` until its delete record is durable; the first accurate one stops the
    /// walk (that queue really holds an old message; the budget flush or a checkpoint seals
    /// it). Runs between rounds on the committer, the only thread that takes entries off the
    /// list; shard locks are taken without the pending lock (the order is shard, then
    /// pending).
    pub(super) fn refresh_listed(&mut self, round: u64) {
        // The rounds before `round` are complete: so are the delete records they held.
        self.gone.retain(|(_, until)| *until >= round);
        let front: Vec<Listed> = {
            let mut pending = lock(&self.inner.pending);
            let count = pending.buffered.len().min(REFRESH_PER_ROUND_MAX);
            pending.buffered.drain(..count).collect()
        };
        let mut kept = Vec::new();
        let mut moved = Vec::new();
        let mut entries = front.into_iter();
        for mut listed in entries.by_ref() {
            let since = {
                let mut shard = lock(self.inner.shard(&listed.key.name));
                match shard.queues.get_mut(&*listed.key.name) {
                    Some(state) if state.incarnation == listed.key.incarnation => {
                        if !state.queued {
                            Some(None)
                        } else if state.buffer.is_none() {
                            // Nothing unsealed (between rounds nothing is frozen): unlisted;
                            // its next append lists it again.
                            state.queued = false;
                            Some(None)
                        } else {
                            Some(Some(state.unsealed_since))
                        }
                    }
                    // Deleted: the delete record is in this round's log at the latest.
                    _ => None,
                }
            };
            match since {
                None => self.gone.push((listed, round)),
                Some(None) => {}
                Some(Some(since)) if since > listed.since_round => {
                    listed.since_round = since;
                    moved.push(listed);
                }
                Some(Some(_)) => {
                    kept.push(listed);
                    break;
                }
            }
        }
        kept.extend(entries);
        if kept.is_empty() && moved.is_empty() {
            return;
        }
        let mut pending = lock(&self.inner.pending);
        for listed in kept.into_iter().rev() {
            pending.buffered.push_front(listed);
        }
        pending.buffered.extend(moved);
    }

    /// The log floor before round `round` starts, `all` being the queues it took off the
    /// buffered list. Every message logged but not yet sealed belongs to a queue on the
    /// buffered list or in `all` (the rounds before `round` are complete, so nothing is
    /// frozen), and each such entry's `since_round` is no later than the round that logged
    /// the queue's oldest unsealed message. So every log record before the start of the
    /// oldest such round is dead: its messages are in chunks of completed rounds, or trimmed,
    /// or deleted. A remembered start at or before that round stands for it (positions only
    /// grow). Prunes the starts before the one used.
    fn floor_for(&mut self, round: u64, all: &[Listed]) -> LogFloor {
        let oldest = {
            let pending = lock(&self.inner.pending);
            pending
                .buffered
                .iter()
                .chain(all)
                .chain(self.gone.iter().map(|(listed, _)| listed))
                .map(|listed| listed.since_round)
                .min()
                .unwrap_or(round)
        };
        if oldest >= round {
            // Nothing unsealed was logged before this round: all of the log so far is dead.
            return LogFloor {
                segment: self.writer.segment,
                position: self.writer.length,
            };
        }
        let known = self
            .round_starts
            .partition_point(|(started, _)| *started <= oldest);
        if known == 0 {
            // Not expected (round 0 is always known); the last floor stays true.
            return self.floor;
        }
        self.round_starts.drain(..known - 1);
        self.round_starts[0].1
    }

    /// Rotates at the start of round `round` (see `floor_for` for `all`), writing the log
    /// floor as of now at the start of the new segment.
    pub(super) fn rotate_with_floor(&mut self, round: u64, all: &[Listed]) -> io::Result<()> {
        // A floor may come out lower than the last one (a remembered round start stands
        // for later rounds, and a rotation that failed wrote its floor nowhere); both are
        // true, so the higher one is kept.
        let floor = self.floor_for(round, all);
        self.floor = floor.max(self.floor);
        self.rotate()?;
        // Segments before the floor's hold no needed log record.
        self.log_floor = self.log_floor.max(self.floor.segment);
        Ok(())
    }

    /// Remembers where round `round` starts (the end of the active segment), unless a round
    /// started less than [`ROUND_START_SPACING_BYTES`] before in the same segment.
    pub(super) fn note_round_start(&mut self, round: u64) {
        let here = LogFloor {
            segment: self.writer.segment,
            position: self.writer.length,
        };
        let near = self.round_starts.back().is_some_and(|(_, last)| {
            last.segment == here.segment
                && here.position.saturating_sub(last.position) < ROUND_START_SPACING_BYTES
        });
        if !near {
            self.round_starts.push_back((round, here));
        }
    }

    /// The segment-deletion floor a completed checkpoint round `round`, whose log went to
    /// `log_segment`, allows. Every message logged in this round or earlier is now in a chunk,
    /// except those marked with a later round, whose log records are in this round's log (in
    /// `log_segment` or later) or in later rounds; and except those of queues deleted with
    /// their delete record still to be written (`gone`): their log records must stay until it
    /// is durable, so the floor stops at the segment where the oldest of those began (`None`:
    /// not known, no raise). Stopping there rather than not raising at all matters: garbage
    /// collection asks for another checkpoint while the floor does not move.
    pub(super) fn checkpoint_floor(&self, round: u64, log_segment: u32) -> Option<u32> {
        let Some(oldest) = self
            .gone
            .iter()
            .filter(|(_, until)| *until > round)
            .map(|(listed, _)| listed.since_round)
            .min()
        else {
            return Some(log_segment);
        };
        let known = self
            .round_starts
            .partition_point(|(started, _)| *started <= oldest);
        let start = self.round_starts.get(known.checked_sub(1)?)?;
        Some(start.1.segment.min(log_segment))
    }
}
