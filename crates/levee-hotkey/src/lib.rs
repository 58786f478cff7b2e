//! Levee's hot-key engine: counts the keys app servers report in sliding windows against
//! per-app rules and says when a key turns hot or cools down. It does no I/O and reads no
//! clock: every call takes the current time in milliseconds, so tests drive it with virtual
//! time.
//!
//! - [`rule`]: [`Rule`]s per app: match (exact key, prefix, or the default `*`), window,
//!   threshold, hot duration; validated with errors that name the field and the range.
//! - [`engine`]: [`HotKeyEngine`], which takes reports and emits [`Event`]s.

#![deny(missing_docs)]

pub mod engine;
mod key_bytes;
pub mod rule;
mod rule_set;
mod sketch;
mod window;

pub use engine::{
    AppStats, BatchOutcome, EngineConfig, Event, HotEvent, HotKeyEngine, HotSource, KeyCount,
    MemoryStats, REPORT_BATCH_KEYS_MAX, ReportError, UnknownAppPolicy,
};
pub use rule::{Rule, RuleError, RuleMatch};
