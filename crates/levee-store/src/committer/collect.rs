//! Collection of old segments: after each round the oldest segments are deleted while nothing
//! live remains in them, first copying forward the trim records they still carry; a segment
//! held only by log records of buffered messages asks for a checkpoint, and a mostly dead one
//! is relocated (see `relocate.rs`).

use super::{Committer, is_no_space};
use crate::format;
use crate::store::{QueueKey, lock};
use std::sync::atomic::Ordering;

/// The oldest segment is relocated once at most 1 in this many of its chunks is still live.
const RELOCATE_LIVE_RATIO_MAX: u64 = 4;

/// Garbage collection asks for a checkpoint when the oldest segment is kept only by log
/// records of buffered messages and the active segment is this many segments ahead.
const CHECKPOINT_LAG_SEGMENTS: u32 = 2;

/// How copying trim records forward before a segment deletion went.
enum Carried {
    Done,
    /// The disk is full: the segment stays for now.
    NoSpace,
    Poisoned,
}

impl Committer<'_> {
    /// Deletes the oldest segments while nothing live remains in them. Trim records in such a
    /// segment that still carry a queue's offsets (queues with no chunk left) are first
    /// copied to the active segment. Returns false once poisoned.
    pub(super) fn collect_garbage(&mut self) -> bool {
        let mut relocated = false;
        loop {
            let (oldest, relocate) = {
                let segments = lock(&self.inner.segments);
                match segments.first_key_value() {
                    Some((&id, entry))
                        if id != self.writer.segment
                            && entry.live_chunks == 0
                            && id >= self.log_floor =>
                    {
                        // Only log records of buffered messages keep it. Budget flushes seal
                        // the oldest buffers first, so the floor usually passes it by a later
                        // rotation; else, once `CHECKPOINT_LAG_SEGMENTS` behind, seal every
                        // buffer in the next round (a checkpoint: a million small chunks at
                        // a million queues, which is why it waits), then it can go.
                        if self.writer.segment - id >= CHECKPOINT_LAG_SEGMENTS {
                            self.checkpoint_wanted = true;
                        }
                        return true;
                    }
                    Some((&id, entry)) if id != self.writer.segment && entry.live_chunks == 0 => {
                        (id, false)
                    }
                    // Mostly dead and with two newer segments: copy its few live chunks forward
                    // so a long-lived queue does not pin every later segment on disk.
                    Some((&id, entry))
                        if !relocated
                            && segments.len() > 2
                            && entry.live_chunks * RELOCATE_LIVE_RATIO_MAX
                                <= entry.chunks_total =>
                    {
                        (id, true)
                    }
                    _ => return true,
                }
            };
            if relocate {
                relocated = true;
                if !self.relocate(oldest) {
                    return false;
                }
                continue;
            }
            match self.carry_trims_forward(oldest) {
                Carried::Done => {}
                Carried::NoSpace => return true,
                Carried::Poisoned => return false,
            }
            let name = format::segment_file_name(oldest);
            if let Err(error) = self.inner.storage.remove(&name) {
                return self.poison(format!("deleting segment {name}: {error}"));
            }
            lock(&self.inner.segments).remove(&oldest);
            self.inner
                .counters
                .segments_deleted
                .fetch_add(1, Ordering::Relaxed);
            match self.inner.storage.sync_dir() {
                Ok(()) => {
                    self.inner
                        .counters
                        .dir_syncs
                        .fetch_add(1, Ordering::Relaxed);
                }
                // The unlink is not durable yet; if the file comes back after a crash it only
                // holds dead chunks and copied-forward trims, and the next directory fsync
                // (rotation or deletion) makes this unlink durable too.
                Err(error) if is_no_space(&error) => return true,
                Err(error) => {
                    return self.poison(format!(
                        "fsyncing the directory after deleting {name}: {error}"
                    ));
                }
            }
        }
    }

    /// Copies to the active segment (and fsyncs it) the trim records of `oldest` that still
    /// carry a queue's offsets: queues with no chunk left, whose trim record is in it.
    fn carry_trims_forward(&mut self, oldest: u32) -> Carried {
        let mut carry = Vec::new();
        let mut carried = Vec::new();
        for shard in &self.inner.shards {
            let shard = lock(shard);
            for state in shard.queues.values() {
                if state.trim_segment == oldest && state.chunks.is_empty() {
                    format::encode_trim(&mut carry, &state.name, state.first_offset);
                    carried.push(QueueKey {
                        name: state.name.clone(),
                        incarnation: state.incarnation,
                    });
                }
            }
        }
        if !carry.is_empty() {
            match self.append_synced(&carry) {
                Ok(_) => {}
                Err(None) => return Carried::NoSpace,
                Err(Some(error)) => {
                    self.poison(format!("copying trim records forward: {error}"));
                    return Carried::Poisoned;
                }
            }
            for key in carried {
                let mut shard = lock(self.inner.shard(&key.name));
                if let Some(state) = shard.queues.get_mut(&*key.name)
                    && state.incarnation == key.incarnation
                {
                    state.trim_segment = self.writer.segment;
                }
            }
        }
        Carried::Done
    }
}
