//! [`HotKeyEngine`]: per-app rules, a heavy-hitter prefilter, exact sliding windows for the keys
//! it admits, hot and cool events, top-K and stats, within a memory budget.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::SharedSeed;
use foldhash::fast::{RandomState, SeedableRandomState};

use crate::app::{App, ENTRY_SLOT_BYTES, Entry, HotState, NO_RULE};
use crate::key_bytes::KeyBytes;
use crate::rule::{HOT_DURATION_MS_MAX, HOT_DURATION_MS_MIN, Rule, RuleError, RuleMatch};
use crate::rule_set::RuleSet;
use crate::sketch::Sketch;
use crate::window::Window;

/// Most items in one [`HotKeyEngine::report_batch`] call.
pub const REPORT_BATCH_KEYS_MAX: usize = 65_536;
/// Entries sampled to choose a victim when the memory budget binds.
pub const EVICTION_SAMPLES: usize = 8;
/// Apps sampled to find one holding more than its share when the budget binds.
const APP_SAMPLES: usize = 4;
/// Items of a batch whose memory loads are started together (see
/// [`HotKeyEngine::report_batch`]).
const BATCH_CHUNK_ITEMS: usize = 64;
/// Default [`EngineConfig::admission_divisor`].
pub const ADMISSION_DIVISOR_DEFAULT: u64 = 8;

/// What the engine does with a report for an app it has not seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownAppPolicy {
    /// Create the app with the default rule (`*`: 1000 hits in 5 s, hot for 60 s).
    Create,
    /// Refuse the report with [`ReportError::UnknownApp`].
    Refuse,
}

/// The engine's bounds.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most bytes the engine's state may use, all apps together.
    pub memory_budget_bytes: usize,
    /// Longest key accepted, in bytes.
    pub key_bytes_max: usize,
    /// Most apps.
    pub apps_max: usize,
    /// What a report for an unknown app does.
    pub unknown_app: UnknownAppPolicy,
    /// Bytes of the Count-Min prefilter shared by all apps (rounded down to a power of two of
    /// 64-byte blocks, and to at most half of `memory_budget_bytes`). More bytes: fewer cold keys
    /// admitted to exact windows under many distinct keys.
    pub sketch_bytes: usize,
    /// A key gets an exact window once its sketch estimate reaches
    /// `max(1, threshold / admission_divisor)` (its rule's admission). Larger: fewer keys tracked,
    /// looser precision bound (see the crate docs).
    pub admission_divisor: u64,
    /// Most tracked keys per app that one [`HotKeyEngine::tick`] inspects to reclaim idle ones
    /// (it resumes where it stopped on the next tick).
    pub reclaim_keys_per_tick: usize,
    /// Seed of the key hash (sketch cells and tables). `None`: a random seed per engine, so that
    /// clients cannot choose keys that collide. `Some`: the same seed gives the same sketch
    /// collisions, for reproducible tests and simulations.
    pub hash_seed: Option<u64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            memory_budget_bytes: 256 * 1024 * 1024,
            key_bytes_max: 1_024,
            apps_max: 10_000,
            unknown_app: UnknownAppPolicy::Create,
            sketch_bytes: 32 * 1024 * 1024,
            admission_divisor: ADMISSION_DIVISOR_DEFAULT,
            reclaim_keys_per_tick: 4_096,
            hash_seed: None,
        }
    }
}

/// Why a report was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReportError {
    /// The key is empty.
    #[error("app '{app}': empty key; report keys of 1 to {max} bytes")]
    EmptyKey {
        /// The app.
        app: String,
        /// The longest key accepted.
        max: usize,
    },
    /// The key is longer than the configured maximum.
    #[error(
        "app '{app}': key of {length} bytes is longer than the maximum {max}; shorten it or raise key_bytes_max"
    )]
    KeyTooLong {
        /// The app.
        app: String,
        /// The key's length.
        length: usize,
        /// The longest key accepted.
        max: usize,
    },
    /// The app does not exist and the policy refuses unknown apps.
    #[error("unknown app '{app}'; create it by setting its rules first")]
    UnknownApp {
        /// The app.
        app: String,
    },
    /// The app name is malformed, or creating it would pass `apps_max`.
    #[error(transparent)]
    InvalidApp(#[from] RuleError),
    /// A manual hot duration out of range.
    #[error("app '{app}': hot duration must be between {min} and {max} ms, got {got}")]
    InvalidDuration {
        /// The app.
        app: String,
        /// The duration given.
        got: u64,
        /// The shortest duration.
        min: u64,
        /// The longest duration.
        max: u64,
    },
    /// A batch with more items than [`REPORT_BATCH_KEYS_MAX`].
    #[error("app '{app}': batch of {items} reports is larger than the maximum {max}; split it")]
    BatchTooLarge {
        /// The app.
        app: String,
        /// Items in the batch.
        items: usize,
        /// The limit.
        max: usize,
    },
    /// A manual hot key needs memory the budget cannot give (no tracked key could be evicted).
    #[error(
        "app '{app}': memory budget of {budget_bytes} bytes is full ({used_bytes} used); raise memory_budget_bytes"
    )]
    OverBudget {
        /// The app.
        app: String,
        /// Bytes used.
        used_bytes: usize,
        /// The budget.
        budget_bytes: usize,
    },
}

/// What [`HotKeyEngine::report_batch`] did with a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Items counted (including those whose key matched no rule).
    pub accepted: usize,
    /// Items skipped because their key was empty or too long.
    pub rejected: usize,
    /// Why the first skipped item was skipped.
    pub first_error: Option<ReportError>,
}

/// Why a key is hot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HotSource {
    /// Its count crossed its rule's threshold.
    Detected,
    /// An operator set it hot.
    Manual,
}

/// A key that turned hot (or whose hot period was extended).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotEvent {
    /// The app.
    pub app: String,
    /// The key.
    pub key: Vec<u8>,
    /// The rule that matched it (for manual keys: the rule that would match).
    pub rule: RuleMatch,
    /// The window count when it turned hot (0 for manual keys).
    pub count: u64,
    /// Until when (engine time, ms) app servers keep it hot.
    pub hot_until_ms: u64,
    /// Detected or manual.
    pub source: HotSource,
}

/// What the engine tells app servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A key turned hot, or its hot period was extended.
    Hot(HotEvent),
    /// A key is no longer hot.
    Cool {
        /// The app.
        app: String,
        /// The key.
        key: Vec<u8>,
    },
}

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

/// Estimated bytes of a cool-queue item beyond its key.
const COOL_ITEM_BYTES: usize = std::mem::size_of::<CoolItem>() + 16;
/// Smallest capacity an app's entry table grows to.
const ENTRIES_CAPACITY_MIN: usize = 16;
/// Sketch generation when no app has rules.
const GENERATION_MS_DEFAULT: u64 = 5_000;

/// A hot period's end, for [`HotKeyEngine::tick`]. Stale items (the key was extended, cooled
/// by hand or its app removed) are skipped when they come up.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct CoolItem {
    hot_until_ms: u64,
    app: Arc<str>,
    key: Box<[u8]>,
}

/// The engine. Not thread-safe by itself: the server shards keys over several engines, each
/// behind its own lock.
///
/// See the crate docs for the counting rule, the error bound and the memory budget.
#[derive(Debug)]
pub struct HotKeyEngine {
    config: EngineConfig,
    hasher: SeedableRandomState,
    apps: Vec<App>,
    app_positions: HashMap<Box<str>, usize, RandomState>,
    sketch: Sketch,
    cool_queue: BinaryHeap<Reverse<CoolItem>>,
    /// The latest time seen: an earlier `now_ms` is taken as this.
    clock_ms: u64,
    next_app_seed: u64,
    random_state: u64,
    budget_evictions: u64,
    /// The sketch, every app's [`App::bytes`] and the cool queue's items.
    used_bytes: usize,
    /// Position of the app resolved last (reports come in runs of one app); `usize::MAX`: none.
    last_app_position: usize,
}

impl HotKeyEngine {
    /// An engine with no apps.
    pub fn new(config: EngineConfig) -> Self {
        let sketch = Sketch::new(
            config.sketch_bytes.min(config.memory_budget_bytes / 2),
            GENERATION_MS_DEFAULT,
        );
        let used_bytes = sketch.bytes();
        let hasher = match config.hash_seed {
            Some(seed) => SeedableRandomState::with_seed(seed, SharedSeed::global_fixed()),
            None => SeedableRandomState::random(),
        };
        Self {
            config,
            hasher,
            apps: Vec::new(),
            app_positions: HashMap::default(),
            sketch,
            cool_queue: BinaryHeap::new(),
            clock_ms: 0,
            next_app_seed: 0x9E37_79B9_7F4A_7C15,
            random_state: 0x2545_F491_4F6C_DD1D,
            budget_evictions: 0,
            used_bytes,
            last_app_position: usize::MAX,
        }
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Replaces an app's rules (creating the app). Keys whose rule did not change keep their
    /// counts; keys whose rule changed start counting afresh under the new rule.
    ///
    /// A key's rule "did not change" when the rule that matches it under the new rules is equal,
    /// field for field, to the one that matched it before. Keys that now match another rule (or
    /// a changed one) lose their window; keys that match nothing are dropped. Hot keys stay hot
    /// until their hot period ends.
    pub fn set_rules(&mut self, app: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        crate::rule::validate_app_name(app)?;
        let rule_set = RuleSet::new(
            app,
            rules,
            self.config.key_bytes_max,
            self.config.admission_divisor,
        )?;
        let position = match self.app_positions.get(app) {
            Some(&position) => position,
            None => self.create_app(app, RuleSet::default())?,
        };
        let now_ms = self.clock_ms;
        let state = &mut self.apps[position];
        let old_rules = std::mem::replace(&mut state.rules, rule_set);
        let mut kept = Vec::with_capacity(state.entries.len());
        let mut dropped_key_bytes = 0;
        for mut entry in state.entries.drain(..) {
            let new_rule = state.rules.find(&entry.key);
            let unchanged = entry.rule != NO_RULE
                && new_rule.is_some_and(|new_rule| {
                    state.rules.get(new_rule).rule == old_rules.get(entry.rule).rule
                });
            if unchanged {
                entry.rule = new_rule.unwrap_or(NO_RULE);
                kept.push(entry);
            } else if entry.hot_until_ms != 0 {
                entry.rule = new_rule.unwrap_or(NO_RULE);
                entry.window = match new_rule {
                    Some(rule) => {
                        let rule = state.rules.get(rule);
                        Window::new(0, now_ms, rule.window_ms, rule.slot_ms)
                    }
                    None => Window::new(0, now_ms, 1_000, 100),
                };
                kept.push(entry);
            } else {
                dropped_key_bytes += entry.key.heap_bytes();
            }
        }
        state.entries = kept;
        state.key_bytes -= dropped_key_bytes;
        state.reclaim_cursor = 0;
        state.rebuild_index();
        self.refresh_bytes(position);
        self.update_sketch_generation();
        Ok(())
    }

    /// An app's rules, or `None` if the app does not exist.
    pub fn rules(&self, app: &str) -> Option<Vec<Rule>> {
        self.app(app).map(|state| state.rules.rules())
    }

    /// The apps, sorted.
    pub fn apps(&self) -> Vec<String> {
        let mut names: Vec<String> = self.apps.iter().map(|app| app.name.to_string()).collect();
        names.sort_unstable();
        names
    }

    /// Removes an app and all its state. Returns whether it existed. No cool events are
    /// emitted for its hot keys.
    pub fn remove_app(&mut self, app: &str) -> bool {
        let Some(position) = self.app_positions.remove(app) else {
            return false;
        };
        self.last_app_position = usize::MAX;
        let removed = self.apps.swap_remove(position);
        self.used_bytes -= removed.bytes;
        if let Some(moved) = self.apps.get(position)
            && let Some(slot) = self.app_positions.get_mut(&*moved.name)
        {
            *slot = position;
        }
        self.update_sketch_generation();
        true
    }

    /// Counts `count` hits of `key` at `now_ms`; pushes a [`Event::Hot`] when the key turns hot
    /// (or its hot period is extended).
    pub fn report(
        &mut self,
        app: &str,
        key: &[u8],
        count: u32,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<(), ReportError> {
        self.check_key(app, key)?;
        let now_ms = self.advance_clock(now_ms);
        let position = self.resolve_app(app)?;
        self.report_resolved(position, key, count, now_ms, events);
        Ok(())
    }

    /// Counts a batch of `(key, count)` reports of one app at `now_ms`, resolving the app once.
    ///
    /// Errors that concern the whole batch (unknown or invalid app, more than
    /// [`REPORT_BATCH_KEYS_MAX`] items) refuse it whole and count nothing. Items with an empty or
    /// too long key are skipped and counted in [`BatchOutcome::rejected`], with the first one's
    /// error in [`BatchOutcome::first_error`]; the other items are counted.
    pub fn report_batch(
        &mut self,
        app: &str,
        items: &[(&[u8], u32)],
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<BatchOutcome, ReportError> {
        if items.len() > REPORT_BATCH_KEYS_MAX {
            return Err(ReportError::BatchTooLarge {
                app: app.to_owned(),
                items: items.len(),
                max: REPORT_BATCH_KEYS_MAX,
            });
        }
        let now_ms = self.advance_clock(now_ms);
        let position = self.resolve_app(app)?;
        let mut outcome = BatchOutcome::default();
        let mut hashes = [0_u64; BATCH_CHUNK_ITEMS];
        let mut untracked = [false; BATCH_CHUNK_ITEMS];
        for chunk in items.chunks(BATCH_CHUNK_ITEMS) {
            untracked.fill(false);
            // Three short passes start the chunk's memory loads (key hashes, table and entries,
            // then the sketch blocks of keys that are not tracked) so that their cache misses
            // overlap, instead of being paid one after another when the reports are counted.
            let state = &self.apps[position];
            for (hash, &(key, _)) in hashes.iter_mut().zip(chunk) {
                *hash = self.hasher.hash_one(key);
            }
            let mut touched = 0_u64;
            for ((missing, &hash), &(key, _)) in untracked.iter_mut().zip(&hashes).zip(chunk) {
                match state.find(hash, key) {
                    Some(entry) => touched ^= state.entries[entry].window.touch(),
                    None => *missing = true,
                }
            }
            for (&missing, &hash) in untracked.iter().zip(&hashes).take(chunk.len()) {
                if missing {
                    touched ^= u64::from(self.sketch.touch(hash ^ state.seed));
                }
            }
            std::hint::black_box(touched);
            for (&hash, &(key, count)) in hashes.iter().zip(chunk) {
                if key.is_empty() || key.len() > self.config.key_bytes_max {
                    outcome.rejected += 1;
                    if outcome.first_error.is_none() {
                        outcome.first_error = self.check_key(app, key).err();
                    }
                    continue;
                }
                outcome.accepted += 1;
                self.report_hashed(position, key, hash, count, now_ms, events);
            }
        }
        Ok(outcome)
    }

    /// Expires hot keys whose hot period ended ([`Event::Cool`]) and reclaims idle windows.
    /// Call every few milliseconds.
    ///
    /// A tracked key is idle when its window count is 0 and it is not hot; each tick inspects
    /// at most [`EngineConfig::reclaim_keys_per_tick`] keys per app.
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

    /// The engine's time: the latest `now_ms` it was given (it never goes back, so an event
    /// made by a call whose `now_ms` was older is dated by this).
    pub fn now_ms(&self) -> u64 {
        self.clock_ms
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

    fn app(&self, app: &str) -> Option<&App> {
        self.app_positions
            .get(app)
            .map(|&position| &self.apps[position])
    }

    fn advance_clock(&mut self, now_ms: u64) -> u64 {
        self.clock_ms = self.clock_ms.max(now_ms);
        self.clock_ms
    }

    fn check_key(&self, app: &str, key: &[u8]) -> Result<(), ReportError> {
        if key.is_empty() {
            return Err(ReportError::EmptyKey {
                app: app.to_owned(),
                max: self.config.key_bytes_max,
            });
        }
        if key.len() > self.config.key_bytes_max {
            return Err(ReportError::KeyTooLong {
                app: app.to_owned(),
                length: key.len(),
                max: self.config.key_bytes_max,
            });
        }
        Ok(())
    }

    /// The app's position, creating it with the default rule if the policy allows.
    #[inline]
    fn resolve_app(&mut self, app: &str) -> Result<usize, ReportError> {
        if let Some(state) = self.apps.get(self.last_app_position)
            && *state.name == *app
        {
            return Ok(self.last_app_position);
        }
        if let Some(&position) = self.app_positions.get(app) {
            self.last_app_position = position;
            return Ok(position);
        }
        if self.config.unknown_app == UnknownAppPolicy::Refuse {
            return Err(ReportError::UnknownApp {
                app: app.to_owned(),
            });
        }
        crate::rule::validate_app_name(app)?;
        let rules = RuleSet::new(
            app,
            vec![Rule::default_rule()],
            self.config.key_bytes_max,
            self.config.admission_divisor,
        )?;
        let position = self.create_app(app, rules)?;
        self.update_sketch_generation();
        Ok(position)
    }

    fn create_app(&mut self, app: &str, rules: RuleSet) -> Result<usize, RuleError> {
        if self.apps.len() >= self.config.apps_max {
            return Err(RuleError::TooManyApps {
                app: app.to_owned(),
                max: self.config.apps_max,
            });
        }
        let seed = self.next_app_seed;
        self.next_app_seed = self.next_app_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let state = App::new(app, seed, rules);
        self.used_bytes += state.bytes;
        let position = self.apps.len();
        self.apps.push(state);
        self.app_positions.insert(app.into(), position);
        Ok(position)
    }

    /// The sketch must remember the longest window of any app.
    fn update_sketch_generation(&mut self) {
        let window_ms_max = self
            .apps
            .iter()
            .map(|app| app.rules.window_ms_max())
            .max()
            .unwrap_or(0);
        let generation_ms = if window_ms_max == 0 {
            GENERATION_MS_DEFAULT
        } else {
            window_ms_max
        };
        self.sketch.set_generation_ms(generation_ms);
    }

    fn refresh_bytes(&mut self, position: usize) {
        let state = &mut self.apps[position];
        let bytes = state.measure_bytes();
        self.used_bytes = self.used_bytes - state.bytes + bytes;
        state.bytes = bytes;
    }

    /// The hot path: one report of a resolved app, key already checked, clock advanced.
    #[inline]
    fn report_resolved(
        &mut self,
        position: usize,
        key: &[u8],
        count: u32,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) {
        let hash = self.hasher.hash_one(key);
        self.report_hashed(position, key, hash, count, now_ms, events);
    }

    /// [`HotKeyEngine::report_resolved`] with the key's hash already computed.
    #[inline]
    fn report_hashed(
        &mut self,
        position: usize,
        key: &[u8],
        hash: u64,
        count: u32,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) {
        let state = &mut self.apps[position];
        state.reports_received += 1;
        state.hits_received += u64::from(count);
        if count == 0 {
            return;
        }
        if let Some(entry_position) = state.find(hash, key) {
            let entry = &mut state.entries[entry_position];
            if entry.rule == NO_RULE {
                return;
            }
            let rule = state.rules.get(entry.rule);
            let total = entry
                .window
                .add(u64::from(count), now_ms, rule.window_ms, rule.slot_ms);
            if total >= rule.rule.threshold
                && entry.hot_until_ms.saturating_sub(now_ms).saturating_mul(2)
                    < rule.rule.hot_duration_ms
            {
                let duration_ms = rule.rule.hot_duration_ms;
                self.make_hot(
                    position,
                    entry_position,
                    total,
                    now_ms,
                    duration_ms,
                    HotSource::Detected,
                    events,
                );
            }
            return;
        }
        let Some(rule_index) = state.rules.find(key) else {
            return;
        };
        let rule = state.rules.get(rule_index);
        let count = u64::from(count);
        // Every untracked hit goes to the sketch, even for rules whose admission is 1 (tracked
        // from their first hit): the estimate is what a key offers against a victim when the
        // budget binds.
        self.sketch.rotate_if_due(now_ms);
        let before = self
            .sketch
            .add(hash ^ state.seed, u32::try_from(count).unwrap_or(u32::MAX));
        if before + count < rule.admission {
            return;
        }
        // The key's true hits within its window before this report are below its admission
        // (see the crate docs), so capping the credit keeps the count from undercounting while
        // bounding how much it can overcount.
        let credit = before.min(rule.admission - 1);
        let estimate = before + count;
        let (window_ms, slot_ms, threshold, duration_ms) = (
            rule.window_ms,
            rule.slot_ms,
            rule.rule.threshold,
            rule.rule.hot_duration_ms,
        );
        let entry = Entry {
            key: KeyBytes::from(key),
            hash,
            window: Window::new(credit + count, now_ms, window_ms, slot_ms),
            rule: rule_index,
            hot_until_ms: 0,
        };
        let Some(entry_position) = self.insert_within_budget(position, entry, estimate, now_ms)
        else {
            return;
        };
        if credit + count >= threshold {
            self.make_hot(
                position,
                entry_position,
                credit + count,
                now_ms,
                duration_ms,
                HotSource::Detected,
                events,
            );
        }
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

    /// Inserts a new entry if the budget allows. If it does not, memory comes from the victim
    /// app (see [`HotKeyEngine::victim_app`]): from this app, one sampled key with a count below
    /// `estimate` is evicted and its slot reused; from another app, a block of such keys is
    /// evicted and that app's table shrunk (see [`HotKeyEngine::make_room_in`]). Returns the
    /// entry's position, or `None` (counted in `budget_evictions`) if the key was kept out.
    fn insert_within_budget(
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
    fn make_room_in(&mut self, victim: usize, bytes: usize, estimate: u64, now_ms: u64) -> bool {
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
    /// `victim` (all its keys, if it has no more) if its count is below `estimate`. Returns whether a key was evicted.
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
    fn victim_app(&mut self, position: usize) -> Option<usize> {
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

    /// Puts an entry in the hot set (or extends it) and pushes its hot event.
    #[allow(clippy::too_many_arguments, reason = "private helper on the cold path")]
    fn make_hot(
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

#[cfg(test)]
mod tests;
