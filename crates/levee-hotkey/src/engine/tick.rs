//! Time passing: [`HotKeyEngine::tick`] rotates the sketch, emits [`Event::Cool`] for hot
//! periods that ended, reclaims idle windows (a bounded number per app and tick, resuming where
//! the last tick stopped) and gives back memory that hot keys' bookkeeping took over the budget.

use std::cmp::Reverse;
use std::hash::BuildHasher;

use crate::app::NO_RULE;

use super::hot::COOL_ITEM_BYTES;
use super::{Event, HotKeyEngine};

impl HotKeyEngine {
    /// Expires hot keys whose hot period ended ([`Event::Cool`]) and reclaims idle windows.
    /// Call every few milliseconds.
    ///
    /// A tracked key is idle when its window count is 0 and it is not hot; each tick inspects
    /// at most [`EngineConfig::reclaim_keys_per_tick`](super::EngineConfig::reclaim_keys_per_tick)
    /// keys per app.
    pub fn tick(&mut self, now_ms: u64, events: &mut Vec<Event>) {
        let now_ms = self.advance_clock(now_ms);
        self.sketch.rotate_if_due(now_ms);
        while self
            .cool_queue
            .peek()
            .is_some_and(|Reverse(item)| item.hot_until_ms <= now_ms)
        {
            let Some(Reverse(item)) = self.cool_queue.pop() else {
                break;
            };
            self.used_bytes -= COOL_ITEM_BYTES + item.key.len();
            let Some(&position) = self.app_positions.get(&*item.app) else {
                continue;
            };
            let state = &mut self.apps[position];
            let current = state.hot.get(&item.key).map(|hot| hot.hot_until_ms);
            if current != Some(item.hot_until_ms) {
                continue;
            }
            state.hot.remove(&item.key);
            state.hot_key_bytes -= item.key.len();
            let hash = self.hasher.hash_one(&*item.key);
            if let Some(entry) = state.find(hash, &item.key) {
                state.entries[entry].hot_until_ms = 0;
            }
            self.refresh_bytes(position);
            events.push(Event::Cool {
                app: item.app.to_string(),
                key: item.key.into_vec(),
            });
        }
        for position in 0..self.apps.len() {
            self.reclaim(position, now_ms);
        }
        // Hot keys' bookkeeping may have passed the budget while every tracked key was hot;
        // keys that cooled since can give it back.
        for position in 0..self.apps.len() {
            let over_bytes = self
                .used_bytes
                .saturating_sub(self.config.memory_budget_bytes);
            if over_bytes == 0 {
                break;
            }
            self.make_room_in(position, over_bytes, u64::MAX, now_ms);
        }
    }

    /// Drops idle entries (count 0, not hot) among the next keys of the app's reclaim cursor.
    fn reclaim(&mut self, position: usize, now_ms: u64) {
        let state = &mut self.apps[position];
        let mut inspected = 0;
        let mut removed = false;
        let mut cursor = state.reclaim_cursor;
        while inspected < self.config.reclaim_keys_per_tick && !state.entries.is_empty() {
            if cursor >= state.entries.len() {
                cursor = 0;
                // One full pass per tick at most.
                if inspected >= state.entries.len() {
                    break;
                }
            }
            inspected += 1;
            let entry = &mut state.entries[cursor];
            let idle = entry.hot_until_ms == 0
                && (entry.rule == NO_RULE || {
                    let rule = state.rules.get(entry.rule);
                    entry
                        .window
                        .count_advanced(now_ms, rule.window_ms, rule.slot_ms)
                        == 0
                });
            if idle {
                state.remove_entry(cursor);
                removed = true;
            } else {
                cursor += 1;
            }
        }
        state.reclaim_cursor = cursor;
        if removed {
            self.refresh_bytes(position);
        }
    }
}
