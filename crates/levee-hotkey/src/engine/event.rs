//! What the engine tells app servers: [`Event`]s (a key turned hot, or cooled) and the
//! [`HotEvent`] that describes a hot key, with why it is hot ([`HotSource`]).

use crate::rule::RuleMatch;

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
