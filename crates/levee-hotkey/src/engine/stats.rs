//! What the engine tells about itself: the top-K keys of an app by window count
//! ([`KeyCount`]), an app's counters ([`AppStats`]) and memory use against the budget
//! ([`MemoryStats`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::HotKeyEngine;

/// A key and its current window count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCount {
    /// The key.
    pub key: Vec<u8>,
    /// Hits within its rule's window now.
    pub count: u64,
}

/// Counters of one app.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppStats {
    /// Hits reported (the sum of report counts).
    pub hits_received: u64,
    /// Reports (key, count pairs) received.
    pub reports_received: u64,
    /// Keys that turned hot by detection.
    pub hot_detected: u64,
    /// Keys hot now.
    pub hot_now: u64,
    /// Keys with an exact window now.
    pub keys_tracked: u64,
}

/// The engine's memory use against its budget.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes used now (estimated from the structures' sizes).
    pub used_bytes: usize,
    /// The budget.
    pub budget_bytes: usize,
    /// Keys with an exact window, all apps.
    pub keys_tracked: u64,
    /// Times the budget kept a key out of the exact windows (or evicted one).
    pub budget_evictions: u64,
}

/// A top-K candidate in a min-heap of the best so far: by count, then by key in reverse so that
/// ties favour the smaller key.
type Ranked<'key> = Reverse<(u64, Reverse<&'key [u8]>)>;

impl HotKeyEngine {
    /// The `n` keys of the app with the highest window counts now, highest first (ties by
    /// key). Keys with a count of 0 are left out. Counts include the admission credit (see the
    /// crate docs). Scans the app's tracked keys with a heap of `n`.
    pub fn top_k(&self, app: &str, n: usize, now_ms: u64) -> Vec<KeyCount> {
        let now_ms = now_ms.max(self.clock_ms);
        let Some(state) = self.app(app) else {
            return Vec::new();
        };
        if n == 0 {
            return Vec::new();
        }
        let mut heap: BinaryHeap<Ranked<'_>> =
            BinaryHeap::with_capacity(n.min(state.entries.len()) + 1);
        for entry in &state.entries {
            let count = state.count_at(entry, now_ms);
            if count == 0 {
                continue;
            }
            let item = Reverse((count, Reverse(&*entry.key)));
            if heap.len() < n {
                heap.push(item);
            } else if heap.peek().is_some_and(|smallest| item < *smallest) {
                heap.pop();
                heap.push(item);
            }
        }
        heap.into_sorted_vec()
            .into_iter()
            .map(|Reverse((count, Reverse(key)))| KeyCount {
                key: key.to_vec(),
                count,
            })
            .collect()
    }

    /// An app's counters, or `None` if it does not exist.
    pub fn stats(&self, app: &str) -> Option<AppStats> {
        self.app(app).map(|state| AppStats {
            hits_received: state.hits_received,
            reports_received: state.reports_received,
            hot_detected: state.hot_detected,
            hot_now: state.hot.len() as u64,
            keys_tracked: state.entries.len() as u64,
        })
    }

    /// Memory use against the budget.
    pub fn memory(&self) -> MemoryStats {
        MemoryStats {
            used_bytes: self.used_bytes,
            budget_bytes: self.config.memory_budget_bytes,
            keys_tracked: self.apps.iter().map(|app| app.entries.len() as u64).sum(),
            budget_evictions: self.budget_evictions,
        }
    }
}
