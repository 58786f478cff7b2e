//! Why a report, a batch or a manual hot key was refused: [`ReportError`], whose messages
//! name the app, what was wrong and the fix.

use crate::rule::RuleError;

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
    /// A batch with more items than [`REPORT_BATCH_KEYS_MAX`](super::REPORT_BATCH_KEYS_MAX).
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
