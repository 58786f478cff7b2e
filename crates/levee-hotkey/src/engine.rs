//! [`HotKeyEngine`]: per-app rules, a heavy-hitter prefilter, exact sliding windows for the keys
//! it admits, hot and cool events, top-K and stats, within a memory budget.

use crate::rule::{Rule, RuleError, RuleMatch};

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
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            memory_budget_bytes: 256 * 1024 * 1024,
            key_bytes_max: 1_024,
            apps_max: 10_000,
            unknown_app: UnknownAppPolicy::Create,
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

/// The engine. Not thread-safe by itself: the server shards keys over several engines, each
/// behind its own lock.
#[derive(Debug)]
pub struct HotKeyEngine {
    config: EngineConfig,
}

impl HotKeyEngine {
    /// An engine with no apps.
    pub fn new(config: EngineConfig) -> Self {
        Self { config }
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Replaces an app's rules (creating the app). Keys whose rule did not change keep their
    /// counts; keys whose rule changed start counting afresh under the new rule.
    pub fn set_rules(&mut self, app: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        let _ = (app, rules);
        todo!()
    }

    /// An app's rules, or `None` if the app does not exist.
    pub fn rules(&self, app: &str) -> Option<Vec<Rule>> {
        let _ = app;
        todo!()
    }

    /// The apps, sorted.
    pub fn apps(&self) -> Vec<String> {
        todo!()
    }

    /// Removes an app and all its state. Returns whether it existed.
    pub fn remove_app(&mut self, app: &str) -> bool {
        let _ = app;
        todo!()
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
        let _ = (app, key, count, now_ms, events);
        todo!()
    }

    /// Expires hot keys whose hot period ended ([`Event::Cool`]) and reclaims idle windows.
    /// Call every few milliseconds.
    pub fn tick(&mut self, now_ms: u64, events: &mut Vec<Event>) {
        let _ = (now_ms, events);
        todo!()
    }

    /// The app's hot keys now (the snapshot a connecting app server receives).
    pub fn hot_keys(&self, app: &str, now_ms: u64) -> Vec<HotEvent> {
        let _ = (app, now_ms);
        todo!()
    }

    /// The `n` keys of the app with the highest window counts now, highest first.
    pub fn top_k(&self, app: &str, n: usize, now_ms: u64) -> Vec<KeyCount> {
        let _ = (app, n, now_ms);
        todo!()
    }

    /// Sets a key hot for `duration_ms` by hand; pushes its [`Event::Hot`].
    pub fn set_manual_hot(
        &mut self,
        app: &str,
        key: &[u8],
        duration_ms: u64,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<(), ReportError> {
        let _ = (app, key, duration_ms, now_ms, events);
        todo!()
    }

    /// Cools a hot key by hand (manual or detected); pushes its [`Event::Cool`]. Returns whether
    /// it was hot.
    pub fn remove_hot(
        &mut self,
        app: &str,
        key: &[u8],
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> bool {
        let _ = (app, key, now_ms, events);
        todo!()
    }

    /// An app's counters, or `None` if it does not exist.
    pub fn stats(&self, app: &str) -> Option<AppStats> {
        let _ = app;
        todo!()
    }

    /// Memory use against the budget.
    pub fn memory(&self) -> MemoryStats {
        todo!()
    }
}
