//! [`HotKeyEngine`]: per-app rules, a heavy-hitter prefilter, exact sliding windows for the keys
//! it admits, hot and cool events, top-K and stats, within a memory budget.
//!
//! This module owns the engine's state ([`HotKeyEngine`]), its construction and the helpers
//! every part uses: the engine clock, app lookup and byte accounting. The engine's other parts,
//! one concept each:
//!
//! - `config.rs`: the bounds and policies an engine is built with ([`EngineConfig`],
//!   [`UnknownAppPolicy`]).
//! - `apps.rs`: apps and their rules: replacing an app's rules (keeping the counts of keys whose
//!   rule did not change), listing, creating and removing apps, and the sketch generation that
//!   follows the longest window.
//! - `report.rs`: the hot path: single reports and batches ([`BatchOutcome`]), key checks, app
//!   resolution, counting a tracked key and admitting an untracked one through the sketch.
//! - `budget.rs`: the memory budget: inserting a tracked key within it, and choosing the app and
//!   the keys that give memory back when it binds.
//! - `hot.rs`: the hot set and the cool queue: turning a key hot, manual hot keys, cooling by
//!   hand, and which keys are hot.
//! - `tick.rs`: time passing: hot periods that end, idle windows reclaimed, memory given back.
//! - `stats.rs`: what the engine tells about itself: top-K, per-app counters, memory use.
//! - `event.rs`: what the engine tells app servers ([`Event`], [`HotEvent`], [`HotSource`]).
//! - `error.rs`: why a report was refused ([`ReportError`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use foldhash::SharedSeed;
use foldhash::fast::{RandomState, SeedableRandomState};

use crate::app::App;
use crate::sketch::Sketch;

pub use budget::EVICTION_SAMPLES;
pub use config::{ADMISSION_DIVISOR_DEFAULT, EngineConfig, UnknownAppPolicy};
pub use error::ReportError;
pub use event::{Event, HotEvent, HotSource};
use hot::CoolItem;
pub use report::{BatchOutcome, REPORT_BATCH_KEYS_MAX};
pub use stats::{AppStats, KeyCount, MemoryStats};

mod apps;
mod budget;
mod config;
mod error;
mod event;
mod hot;
mod report;
mod stats;
#[cfg(test)]
mod tests;
mod tick;

/// Sketch generation when no app has rules.
const GENERATION_MS_DEFAULT: u64 = 5_000;

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

    /// The engine's time: the latest `now_ms` it was given (it never goes back, so an event
    /// made by a call whose `now_ms` was older is dated by this).
    pub fn now_ms(&self) -> u64 {
        self.clock_ms
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

    fn refresh_bytes(&mut self, position: usize) {
        let state = &mut self.apps[position];
        let bytes = state.measure_bytes();
        self.used_bytes = self.used_bytes - state.bytes + bytes;
        state.bytes = bytes;
    }
}
