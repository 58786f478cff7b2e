//! The hot set and the cool queue: turning a key hot or extending its hot period
//! ([`HotKeyEngine::make_hot`], for detected and manual keys alike), manual hot keys and the
//! tracked entry they get, cooling a key by hand, and which keys of an app are hot now.

use std::cmp::Reverse;
use std::hash::BuildHasher;
use std::sync::Arc;

use crate::app::{Entry, HotState, NO_RULE};
use crate::key_bytes::KeyBytes;
use crate::rule::{HOT_DURATION_MS_MAX, HOT_DURATION_MS_MIN};
use crate::window::Window;

use super::{Event, HotEvent, HotKeyEngine, HotSource, ReportError};

/// Estimated bytes of a cool-queue item beyond its key.
pub(super) const COOL_ITEM_BYTES: usize = std::mem::size_of::<CoolItem>() + 16;

/// A hot period's end, for [`HotKeyEngine::tick`]. Stale items (the key was extended, cooled
/// by hand or its app removed) are skipped when they come up.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct CoolItem {
    pub(super) hot_until_ms: u64,
    pub(super) app: Arc<str>,
    pub(super) key: Box<[u8]>,
}

impl HotKeyEngine {
    /// The app's hot keys now (the snapshot a connecting app server receives), sorted by key.
    pub fn hot_keys(&self, app: &str, now_ms: u64) -> Vec<HotEvent> {
        let now_ms = now_ms.max(self.clock_ms);
        let Some(state) = self.app(app) else {
            return Vec::new();
        };
        let mut hot: Vec<HotEvent> = state
            .hot
            .iter()
            .filter(|(_, hot)| hot.hot_until_ms > now_ms)
            .map(|(key, hot)| HotEvent {
                app: app.to_owned(),
                key: key.to_vec(),
                rule: hot.rule.clone(),
                count: hot.count,
                hot_until_ms: hot.hot_until_ms,
                source: hot.source,
            })
            .collect();
        hot.sort_unstable_by(|left, right| left.key.cmp(&right.key));
        hot
    }

    /// Whether a key of the app is hot at `now_ms`.
    pub fn is_hot(&self, app: &str, key: &[u8], now_ms: u64) -> bool {
        let now_ms = now_ms.max(self.clock_ms);
        self.app(app)
            .and_then(|state| state.hot.get(key))
            .is_some_and(|hot| hot.hot_until_ms > now_ms)
    }

    /// Sets a key hot for `duration_ms` by hand; pushes its [`Event::Hot`].
    ///
    /// The key gets a tracked entry (counted as usual if a rule matches it) that stays until
    /// the hot period ends. Fails with [`ReportError::OverBudget`] if the budget has no room
    /// and no key can be evicted.
    pub fn set_manual_hot(
        &mut self,
        app: &str,
        key: &[u8],
        duration_ms: u64,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<(), ReportError> {
        self.check_key(app, key)?;
        if !(HOT_DURATION_MS_MIN..=HOT_DURATION_MS_MAX).contains(&duration_ms) {
            return Err(ReportError::InvalidDuration {
                app: app.to_owned(),
                got: duration_ms,
                min: HOT_DURATION_MS_MIN,
                max: HOT_DURATION_MS_MAX,
            });
        }
        let now_ms = self.advance_clock(now_ms);
        let position = self.resolve_app(app)?;
        let hash = self.hasher.hash_one(key);
        let existing = self.apps[position].find(hash, key);
        let Some(entry) =
            existing.or_else(|| self.insert_manual_entry(position, key, hash, now_ms))
        else {
            return Err(ReportError::OverBudget {
                app: app.to_owned(),
                used_bytes: self.used_bytes,
                budget_bytes: self.config.memory_budget_bytes,
            });
        };
        self.make_hot(
            position,
            entry,
            0,
            now_ms,
            duration_ms,
            HotSource::Manual,
            events,
        );
        Ok(())
    }

    /// Cools a hot key by hand (manual or detected); pushes its [`Event::Cool`]. Returns whether
    /// it was hot.
    ///
    /// A detected key that is still over its threshold turns hot again on its next report.
    pub fn remove_hot(
        &mut self,
        app: &str,
        key: &[u8],
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> bool {
        self.advance_clock(now_ms);
        let Some(&position) = self.app_positions.get(app) else {
            return false;
        };
        let hash = self.hasher.hash_one(key);
        let state = &mut self.apps[position];
        let Some((key, _)) = state.hot.remove_entry(key) else {
            return false;
        };
        state.hot_key_bytes -= key.len();
        if let Some(entry) = state.find(hash, &key) {
            state.entries[entry].hot_until_ms = 0;
        }
        self.refresh_bytes(position);
        events.push(Event::Cool {
            app: app.to_owned(),
            key: key.into_vec(),
        });
        true
    }

    /// A tracked entry for a manual hot key that has none: counted from its sketch credit if a
    /// rule matches it. `None` if the budget has no room.
    fn insert_manual_entry(
        &mut self,
        position: usize,
        key: &[u8],
        hash: u64,
        now_ms: u64,
    ) -> Option<usize> {
        let state = &self.apps[position];
        let (rule, window) = match state.rules.find(key) {
            Some(index) => {
                let compiled = state.rules.get(index);
                let estimate = self.sketch.estimate(hash ^ state.seed);
                let credit = estimate.min(compiled.admission - 1);
                let window = Window::new(credit, now_ms, compiled.window_ms, compiled.slot_ms);
                (index, window)
            }
            None => (NO_RULE, Window::new(0, now_ms, 1_000, 100)),
        };
        let entry = Entry {
            key: KeyBytes::from(key),
            hash,
            window,
            rule,
            hot_until_ms: 0,
        };
        self.insert_within_budget(position, entry, u64::MAX, now_ms)
    }

    /// Puts an entry in the hot set (or extends it) and pushes its hot event.
    #[allow(clippy::too_many_arguments, reason = "private helper on the cold path")]
    pub(super) fn make_hot(
        &mut self,
        position: usize,
        entry_position: usize,
        count: u64,
        now_ms: u64,
        duration_ms: u64,
        source: HotSource,
        events: &mut Vec<Event>,
    ) {
        let state = &mut self.apps[position];
        let hot_until_ms = now_ms.saturating_add(duration_ms);
        let rule = state.rule_match(state.entries[entry_position].rule);
        let entry = &mut state.entries[entry_position];
        let was_hot = entry.hot_until_ms > now_ms;
        entry.hot_until_ms = hot_until_ms;
        let key: Box<[u8]> = Box::from(&*entry.key);
        if !was_hot && source == HotSource::Detected {
            state.hot_detected += 1;
        }
        let hot = HotState {
            rule: rule.clone(),
            count,
            hot_until_ms,
            source,
        };
        if let Some(existing) = state.hot.get_mut(&key) {
            *existing = hot;
        } else {
            state.hot_key_bytes += key.len();
            state.hot.insert(key.clone(), hot);
        }
        self.used_bytes += COOL_ITEM_BYTES + key.len();
        self.cool_queue.push(Reverse(CoolItem {
            hot_until_ms,
            app: Arc::clone(&state.name),
            key: key.clone(),
        }));
        events.push(Event::Hot(HotEvent {
            app: state.name.to_string(),
            key: key.into_vec(),
            rule,
            count,
            hot_until_ms,
            source,
        }));
        self.refresh_bytes(position);
        // The hot set and the cool queue grew: if that passed the budget, give it back from
        // cold keys (hot keys are never evicted).
        let over_bytes = self
            .used_bytes
            .saturating_sub(self.config.memory_budget_bytes);
        if over_bytes > 0
            && let Some(victim) = self.victim_app(position)
        {
            self.make_room_in(victim, over_bytes, u64::MAX, now_ms);
        }
    }
}
