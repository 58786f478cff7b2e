//! Rules: which keys of an app are hot at how many hits in which window, and for how long.

use std::fmt;

/// Shortest window.
pub const WINDOW_MS_MIN: u32 = 100;
/// Longest window (10 minutes).
pub const WINDOW_MS_MAX: u32 = 600_000;
/// Shortest hot duration.
pub const HOT_DURATION_MS_MIN: u64 = 1;
/// Longest hot duration (1 day).
pub const HOT_DURATION_MS_MAX: u64 = 86_400_000;
/// Largest threshold.
pub const THRESHOLD_MAX: u64 = 1_000_000_000_000;
/// Most rules per app.
pub const RULES_PER_APP_MAX: usize = 1_000;
/// Longest description.
pub const DESCRIPTION_BYTES_MAX: usize = 1_024;

/// Which keys a rule applies to. Precedence: exact, then the longest prefix, then default.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RuleMatch {
    /// Exactly this key.
    Exact(Vec<u8>),
    /// Every key that starts with these bytes.
    Prefix(Vec<u8>),
    /// Every key no other rule matches (`*`).
    Default,
}

impl fmt::Display for RuleMatch {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleMatch::Exact(key) => write!(formatter, "key '{}'", String::from_utf8_lossy(key)),
            RuleMatch::Prefix(prefix) => {
                write!(formatter, "prefix '{}'", String::from_utf8_lossy(prefix))
            }
            RuleMatch::Default => formatter.write_str("'*'"),
        }
    }
}

/// One rule of an app.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Which keys it applies to.
    pub matcher: RuleMatch,
    /// The sliding window, in milliseconds (100 to 600000).
    pub window_ms: u32,
    /// Hits within the window that make a key hot (1 to 10^12).
    pub threshold: u64,
    /// How long app servers keep a hot key hot and cached, in milliseconds (1 to 86400000).
    pub hot_duration_ms: u64,
    /// For people.
    pub description: String,
}

impl Rule {
    /// The default rule of a new app: `*`, 1000 hits in 5 s, hot for 60 s (as JD hotkey).
    pub fn default_rule() -> Self {
        Self {
            matcher: RuleMatch::Default,
            window_ms: 5_000,
            threshold: 1_000,
            hot_duration_ms: 60_000,
            description: "default: 1000 hits in 5 s, hot for 60 s".to_owned(),
        }
    }

    /// Checks every field; the error names the rule, the field and the allowed range.
    pub fn validate(&self) -> Result<(), RuleError> {
        todo!("implemented by the engine work")
    }
}

/// Why a rule or rule set was refused. Messages name the rule, the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// A field is out of range.
    #[error("rule {rule}: {field} must be {allowed}, got {got}")]
    InvalidField {
        /// The rule's match, as displayed.
        rule: String,
        /// The field's name, such as `window_ms`.
        field: &'static str,
        /// The allowed range or form.
        allowed: String,
        /// The value given.
        got: String,
    },
    /// Two rules have the same match.
    #[error("rule {rule} appears twice; keep one")]
    Duplicate {
        /// The rule's match, as displayed.
        rule: String,
    },
    /// Too many rules for one app.
    #[error("app '{app}': at most {max} rules, got {got}; merge rules or use prefixes")]
    TooMany {
        /// The app.
        app: String,
        /// The limit.
        max: usize,
        /// How many were given.
        got: usize,
    },
    /// The app name is empty or too long.
    #[error("app name must be 1 to 128 bytes of letters, digits, '-', '_' or '.', got '{app}'")]
    InvalidApp {
        /// The name given.
        app: String,
    },
}
