//! The memory budget: inserting a tracked key within it, and when it binds, choosing the app
//! that gives memory back (the key's own app if it holds its fair share, else the biggest of a
//! few sampled) and evicting its sampled keys with the lowest counts, shrinking its table.

use crate::app::{ENTRY_SLOT_BYTES, Entry};

use super::HotKeyEngine;

/// Entries sampled to choose a victim when the memory budget binds.
pub const EVICTION_SAMPLES: usize = 8;

/// Apps sampled to find one holding more than its share when the budget binds.
const APP_SAMPLES: usize = 4;

/// Smallest capacity an app's entry table grows to.
const ENTRIES_CAPACITY_MIN: usize = 16;

impl HotKeyEngine {
    /// Inserts a new entry if the budget allows. If it does not, memory comes from the victim
    /// app (see [`HotKeyEngine::victim_app`]): from this app, one sampled key with a count below
    /// `estimate` is evicted and its slot reused; from another app, a block of such keys is
    /// evicted and that app's table shrunk (see [`HotKeyEngine::make_room_in`]). Returns the
    /// entry's position, or `None` (counted in `budget_evictions`) if the key was kept out.
    pub(super) fn insert_within_budget(
        &mut self,
        position: usize,
        entry: Entry,
        estimate: u64,
        now_ms: u64,
    ) -> Option<usize> {
        let budget = self.config.memory_budget_bytes;
        let key_bytes = entry.key.heap_bytes();
        let mut attempts_left = 4;
        loop {
            let state = &self.apps[position];
            let grow = state.entries.len() == state.entries.capacity();
            let room = budget.saturating_sub(self.used_bytes);
            // `used_bytes` can be above the budget after hot keys' bookkeeping: then `room` is
            // 0 and this admission must first give memory back.
            if !grow && self.used_bytes + key_bytes <= budget {
                break;
            }
            if grow {
                let capacity = state.entries.capacity();
                let wanted = capacity.max(ENTRIES_CAPACITY_MIN);
                let affordable = room.saturating_sub(key_bytes) / ENTRY_SLOT_BYTES;
                let additional = wanted.min(affordable);
                if additional > 0 {
                    let state = &mut self.apps[position];
                    state.entries.reserve_exact(additional);
                    let entries = &state.entries;
                    state
                        .index
                        .reserve(additional, |&other| entries[other].hash);
                    self.refresh_bytes(position);
                    continue;
                }
            }
            let within_budget = self.used_bytes <= budget;
            let freed = attempts_left > 0
                && match self.victim_app(position) {
                    // A slot of this app's table is enough: evict one key and reuse its slot.
                    Some(victim) if victim == position && grow && within_budget => {
                        self.evict_from(position, estimate, now_ms)
                    }
                    Some(victim) => {
                        let growth_bytes = if grow {
                            ENTRIES_CAPACITY_MIN * ENTRY_SLOT_BYTES
                        } else {
                            0
                        };
                        let wanted_bytes =
                            (self.used_bytes + key_bytes + growth_bytes).saturating_sub(budget);
                        self.make_room_in(victim, wanted_bytes, estimate, now_ms)
                    }
                    None => false,
                };
            if !freed {
                self.budget_evictions += 1;
                return None;
            }
            attempts_left -= 1;
        }
        let entry_position = self.apps[position].push_entry(entry);
        self.refresh_bytes(position);
        Some(entry_position)
    }

    /// Frees at least `bytes` of the budget from app `victim`: evicts a block of sampled keys
    /// with counts below `estimate` (at least `bytes` worth, 16 keys and 1/16 of the app, so the
    /// table's shrinking copy is paid once per many evictions) and shrinks its table to fit.
    /// Returns whether any key was evicted.
    pub(super) fn make_room_in(
        &mut self,
        victim: usize,
        bytes: usize,
        estimate: u64,
        now_ms: u64,
    ) -> bool {
        let length = self.apps[victim].entries.len();
        let wanted = bytes
            .div_ceil(ENTRY_SLOT_BYTES)
            .max(length / 16)
            .max(ENTRIES_CAPACITY_MIN)
            .min(length);
        let mut evicted = 0;
        while evicted < wanted && self.evict_from(victim, estimate, now_ms) {
            evicted += 1;
        }
        if evicted == 0 {
            return false;
        }
        let state = &mut self.apps[victim];
        let length = state.entries.len();
        state.entries.shrink_to(length);
        let entries = &state.entries;
        state.index.shrink_to(length, |&other| entries[other].hash);
        self.refresh_bytes(victim);
        true
    }

    /// Evicts the lowest-count key among [`EVICTION_SAMPLES`] sampled non-hot keys of app
    /// `victim_app` (all its keys, if it has no more) if its count is below `estimate`. Returns
    /// whether a key was evicted.
    fn evict_from(&mut self, victim_app: usize, estimate: u64, now_ms: u64) -> bool {
        let length = self.apps[victim_app].entries.len();
        if length == 0 {
            return false;
        }
        let mut victim: Option<(u64, usize)> = None;
        // A small app is scanned whole rather than sampled, so that its cold keys are found.
        for attempt in 0..EVICTION_SAMPLES.min(length) {
            let sample = if length <= EVICTION_SAMPLES {
                attempt
            } else {
                self.next_random_below(length)
            };
            let state = &self.apps[victim_app];
            let entry = &state.entries[sample];
            if entry.hot_until_ms != 0 {
                continue;
            }
            let count = state.count_at(entry, now_ms);
            if victim.is_none_or(|(lowest, _)| count < lowest) {
                victim = Some((count, sample));
            }
        }
        match victim {
            Some((count, sample)) if count < estimate => {
                self.apps[victim_app].remove_entry(sample);
                self.budget_evictions += 1;
                self.refresh_bytes(victim_app);
                true
            }
            _ => false,
        }
    }

    /// The app that gives memory to an admission in app `position`: the app itself if it holds
    /// at least its fair share of the budget (budget / apps), else the app holding the most
    /// among a few sampled (all apps, when there are few), so that one app filling the budget
    /// cannot keep the others out. `None` if no candidate app has a tracked key.
    pub(super) fn victim_app(&mut self, position: usize) -> Option<usize> {
        let own = &self.apps[position];
        let fair_share_bytes = self.config.memory_budget_bytes / self.apps.len().max(1);
        if !own.entries.is_empty() && own.bytes >= fair_share_bytes {
            return Some(position);
        }
        let mut biggest: Option<usize> = None;
        let app_count = self.apps.len();
        for sample in 0..APP_SAMPLES.min(app_count) {
            let other = if app_count <= APP_SAMPLES {
                sample
            } else {
                self.next_random_below(app_count)
            };
            let candidate = &self.apps[other];
            if !candidate.entries.is_empty()
                && biggest.is_none_or(|best| candidate.bytes > self.apps[best].bytes)
            {
                biggest = Some(other);
            }
        }
        let own = &self.apps[position];
        match biggest {
            Some(other) if self.apps[other].bytes > own.bytes => Some(other),
            _ if !own.entries.is_empty() => Some(position),
            other => other,
        }
    }

    fn next_random_below(&mut self, bound: usize) -> usize {
        // xorshift64*: cheap and deterministic; eviction sampling needs no more.
        self.random_state ^= self.random_state >> 12;
        self.random_state ^= self.random_state << 25;
        self.random_state ^= self.random_state >> 27;
        let random = self.random_state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let bound = u64::try_from(bound).unwrap_or(u64::MAX);
        usize::try_from(random % bound.max(1)).unwrap_or_default()
    }
}
