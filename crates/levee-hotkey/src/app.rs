//! [`App`]: one app's state inside the engine: its rules, its tracked keys ([`Entry`]: an exact
//! window and hot state each, found by key hash), its hot set and its counters.

use std::collections::HashMap;
use std::sync::Arc;

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use crate::engine::HotSource;
use crate::key_bytes::KeyBytes;
use crate::rule::RuleMatch;
use crate::rule_set::RuleSet;
use crate::window::Window;

/// Rule index of an entry whose key matches no rule (a manual hot key): never counted.
pub(crate) const NO_RULE: u32 = u32::MAX;
/// Estimated bytes per entry slot beyond the key: the entry and its hash-table slot.
pub(crate) const ENTRY_SLOT_BYTES: usize = std::mem::size_of::<Entry>() + 16;
/// Estimated bytes of a hot-set item beyond its key.
pub(crate) const HOT_ITEM_BYTES: usize = std::mem::size_of::<HotState>() + 48;
/// Estimated bytes of an app beyond its rules, entries and hot set.
pub(crate) const APP_BYTES: usize = std::mem::size_of::<App>() + 256;
/// A tracked key: its exact window and hot state. Laid out (C order, cache-line aligned) so
/// that a lookup and the common update touch the first line and one line of slots.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct Entry {
    pub(crate) hash: u64,
    pub(crate) key: KeyBytes,
    /// Index into the app's rules, or [`NO_RULE`].
    pub(crate) rule: u32,
    /// Until when it is hot; 0 when it is not in the hot set.
    pub(crate) hot_until_ms: u64,
    pub(crate) window: Window,
}

/// A key in an app's hot set.
#[derive(Debug, Clone)]
pub(crate) struct HotState {
    pub(crate) rule: RuleMatch,
    pub(crate) count: u64,
    pub(crate) hot_until_ms: u64,
    pub(crate) source: HotSource,
}

/// One app: its rules, tracked keys, hot set and counters.
#[derive(Debug)]
pub(crate) struct App {
    pub(crate) name: Arc<str>,
    /// Mixed into sketch hashes so that apps do not share cells key for key.
    pub(crate) seed: u64,
    pub(crate) rules: RuleSet,
    pub(crate) entries: Vec<Entry>,
    /// Positions in `entries`, by key hash.
    pub(crate) index: HashTable<usize>,
    pub(crate) hot: HashMap<Box<[u8]>, HotState, RandomState>,
    pub(crate) hits_received: u64,
    pub(crate) reports_received: u64,
    pub(crate) hot_detected: u64,
    pub(crate) key_bytes: usize,
    pub(crate) hot_key_bytes: usize,
    pub(crate) reclaim_cursor: usize,
    /// Bytes as last counted into the engine's total.
    pub(crate) bytes: usize,
}

impl App {
    pub(crate) fn new(name: &str, seed: u64, rules: RuleSet) -> Self {
        let mut app = Self {
            name: Arc::from(name),
            seed,
            rules,
            entries: Vec::new(),
            index: HashTable::new(),
            hot: HashMap::default(),
            hits_received: 0,
            reports_received: 0,
            hot_detected: 0,
            key_bytes: 0,
            hot_key_bytes: 0,
            reclaim_cursor: 0,
            bytes: 0,
        };
        app.bytes = app.measure_bytes();
        app
    }

    pub(crate) fn measure_bytes(&self) -> usize {
        APP_BYTES
            + self.name.len()
            + self.rules.bytes()
            + self.entries.capacity() * ENTRY_SLOT_BYTES
            + self.key_bytes
            + self.hot.len() * HOT_ITEM_BYTES
            + self.hot_key_bytes
    }

    pub(crate) fn find(&self, hash: u64, key: &[u8]) -> Option<usize> {
        let entries = &self.entries;
        self.index
            .find(hash, |&position| {
                let entry = &entries[position];
                entry.hash == hash && *entry.key == *key
            })
            .copied()
    }

    pub(crate) fn push_entry(&mut self, entry: Entry) -> usize {
        let position = self.entries.len();
        let hash = entry.hash;
        self.key_bytes += entry.key.heap_bytes();
        self.entries.push(entry);
        let entries = &self.entries;
        self.index
            .insert_unique(hash, position, |&other| entries[other].hash);
        position
    }

    pub(crate) fn remove_entry(&mut self, position: usize) -> Entry {
        let hash = self.entries[position].hash;
        if let Ok(found) = self.index.find_entry(hash, |&other| other == position) {
            found.remove();
        }
        let last = self.entries.len() - 1;
        let removed = self.entries.swap_remove(position);
        if position != last {
            let moved_hash = self.entries[position].hash;
            if let Some(slot) = self.index.find_mut(moved_hash, |&other| other == last) {
                *slot = position;
            }
        }
        self.key_bytes -= removed.key.heap_bytes();
        removed
    }

    pub(crate) fn rebuild_index(&mut self) {
        self.index.clear();
        let entries = &self.entries;
        for (position, entry) in entries.iter().enumerate() {
            self.index
                .insert_unique(entry.hash, position, |&other| entries[other].hash);
        }
    }

    /// The entry's window count at `now_ms` (0 for keys that match no rule).
    pub(crate) fn count_at(&self, entry: &Entry, now_ms: u64) -> u64 {
        if entry.rule == NO_RULE {
            return 0;
        }
        let rule = self.rules.get(entry.rule);
        entry.window.count_at(now_ms, rule.window_ms, rule.slot_ms)
    }

    pub(crate) fn rule_match(&self, rule: u32) -> RuleMatch {
        if rule == NO_RULE {
            RuleMatch::Default
        } else {
            self.rules.get(rule).rule.matcher.clone()
        }
    }
}
