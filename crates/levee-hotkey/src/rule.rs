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
/// Longest exact key or prefix a rule may name. The engine also holds rule keys to its
/// configured `key_bytes_max`, which may be smaller.
pub const RULE_KEY_BYTES_MAX: usize = 1_024;
/// Longest app name.
pub const APP_NAME_BYTES_MAX: usize = 128;

/// Checks an app name: 1 to [`APP_NAME_BYTES_MAX`] bytes of `[A-Za-z0-9._-]`.
pub fn validate_app_name(app: &str) -> Result<(), RuleError> {
    let valid = !app.is_empty()
        && app.len() <= APP_NAME_BYTES_MAX
        && app
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(RuleError::InvalidApp {
            app: app.to_owned(),
        })
    }
}

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

/// Most bytes of a key quoted in a message; a longer one is cut and its length given.
pub const QUOTED_KEY_BYTES_MAX: usize = 64;

/// `key` for a message: as text, cut after [`QUOTED_KEY_BYTES_MAX`] bytes with its length
/// said, so an error about a long key does not send the key back whole.
pub fn quoted_key(key: &[u8]) -> String {
    if key.len() <= QUOTED_KEY_BYTES_MAX {
        return format!("'{}'", String::from_utf8_lossy(key));
    }
    format!(
        "'{}...' ({} bytes)",
        String::from_utf8_lossy(&key[..QUOTED_KEY_BYTES_MAX]),
        key.len()
    )
}

impl fmt::Display for RuleMatch {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleMatch::Exact(key) => write!(formatter, "key {}", quoted_key(key)),
            RuleMatch::Prefix(prefix) => write!(formatter, "prefix {}", quoted_key(prefix)),
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
    ///
    /// Exact keys and prefixes are checked against [`RULE_KEY_BYTES_MAX`] here; the engine
    /// also checks them against its configured `key_bytes_max` when the rules are set.
    pub fn validate(&self) -> Result<(), RuleError> {
        self.validate_with_key_bytes_max(RULE_KEY_BYTES_MAX)
    }

    /// [`Rule::validate`], with exact keys and prefixes held to `key_bytes_max` bytes.
    pub fn validate_with_key_bytes_max(&self, key_bytes_max: usize) -> Result<(), RuleError> {
        let key_bytes_max = key_bytes_max.min(RULE_KEY_BYTES_MAX);
        match &self.matcher {
            RuleMatch::Exact(key) | RuleMatch::Prefix(key)
                if key.is_empty() || key.len() > key_bytes_max =>
            {
                let field = if matches!(self.matcher, RuleMatch::Exact(_)) {
                    "key"
                } else {
                    "prefix"
                };
                return Err(self.invalid(
                    field,
                    format!("1 to {key_bytes_max} bytes long"),
                    format!("{} bytes", key.len()),
                ));
            }
            _ => {}
        }
        if !(WINDOW_MS_MIN..=WINDOW_MS_MAX).contains(&self.window_ms) {
            return Err(self.invalid(
                "window_ms",
                format!("between {WINDOW_MS_MIN} and {WINDOW_MS_MAX}"),
                self.window_ms.to_string(),
            ));
        }
        if !(1..=THRESHOLD_MAX).contains(&self.threshold) {
            return Err(self.invalid(
                "threshold",
                format!("between 1 and {THRESHOLD_MAX}"),
                self.threshold.to_string(),
            ));
        }
        if !(HOT_DURATION_MS_MIN..=HOT_DURATION_MS_MAX).contains(&self.hot_duration_ms) {
            return Err(self.invalid(
                "hot_duration_ms",
                format!("between {HOT_DURATION_MS_MIN} and {HOT_DURATION_MS_MAX}"),
                self.hot_duration_ms.to_string(),
            ));
        }
        if self.description.len() > DESCRIPTION_BYTES_MAX {
            return Err(self.invalid(
                "description",
                format!("at most {DESCRIPTION_BYTES_MAX} bytes"),
                format!("{} bytes", self.description.len()),
            ));
        }
        Ok(())
    }

    fn invalid(&self, field: &'static str, allowed: String, got: String) -> RuleError {
        RuleError::InvalidField {
            rule: self.matcher.to_string(),
            field,
            allowed,
            got,
        }
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
    #[error(
        "app name must be 1 to {APP_NAME_BYTES_MAX} bytes of letters, digits, '-', '_' or '.', \
         got '{app}'"
    )]
    InvalidApp {
        /// The name given.
        app: String,
    },
    /// Creating the app would pass the engine's `apps_max`.
    #[error(
        "cannot create app '{app}': the engine holds its maximum of {max} apps; remove an app or raise apps_max"
    )]
    TooManyApps {
        /// The app that was not created.
        app: String,
        /// The limit.
        max: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix_rule(prefix: &str) -> Rule {
        Rule {
            matcher: RuleMatch::Prefix(prefix.as_bytes().to_vec()),
            ..Rule::default_rule()
        }
    }

    #[test]
    fn given_default_rule_when_validated_should_pass() {
        assert_eq!(Rule::default_rule().validate(), Ok(()));
    }

    #[test]
    fn given_window_out_of_range_when_validated_should_name_rule_field_and_range() {
        let rule = Rule {
            window_ms: 0,
            ..prefix_rule("pin_")
        };
        let message = rule.validate().unwrap_err().to_string();
        assert_eq!(
            message,
            "rule prefix 'pin_': window_ms must be between 100 and 600000, got 0"
        );
        let rule = Rule {
            window_ms: 600_001,
            ..prefix_rule("pin_")
        };
        assert!(rule.validate().is_err());
        let rule = Rule {
            window_ms: 100,
            ..prefix_rule("pin_")
        };
        assert_eq!(rule.validate(), Ok(()));
    }

    #[test]
    fn given_bad_threshold_duration_description_when_validated_should_name_each_field() {
        let cases = [
            (
                Rule {
                    threshold: 0,
                    ..Rule::default_rule()
                },
                "rule '*': threshold must be between 1 and 1000000000000, got 0",
            ),
            (
                Rule {
                    threshold: THRESHOLD_MAX + 1,
                    ..Rule::default_rule()
                },
                "rule '*': threshold must be between 1 and 1000000000000, got 1000000000001",
            ),
            (
                Rule {
                    hot_duration_ms: 0,
                    ..Rule::default_rule()
                },
                "rule '*': hot_duration_ms must be between 1 and 86400000, got 0",
            ),
            (
                Rule {
                    description: "x".repeat(1_025),
                    ..Rule::default_rule()
                },
                "rule '*': description must be at most 1024 bytes, got 1025 bytes",
            ),
        ];
        for (rule, expected) in cases {
            assert_eq!(rule.validate().unwrap_err().to_string(), expected);
        }
    }

    #[test]
    fn given_empty_or_long_rule_key_when_validated_should_name_key_and_range() {
        let message = prefix_rule("").validate().unwrap_err().to_string();
        assert_eq!(
            message,
            "rule prefix '': prefix must be 1 to 1024 bytes long, got 0 bytes"
        );
        let rule = Rule {
            matcher: RuleMatch::Exact(b"abcdef".to_vec()),
            ..Rule::default_rule()
        };
        let message = rule.validate_with_key_bytes_max(4).unwrap_err().to_string();
        assert_eq!(
            message,
            "rule key 'abcdef': key must be 1 to 4 bytes long, got 6 bytes"
        );
    }

    #[test]
    fn given_a_long_key_in_a_message_then_it_is_cut_and_its_length_said() {
        let long = RuleMatch::Exact(vec![b'k'; 1_025]);
        let shown = long.to_string();
        assert!(shown.len() < 100, "{shown}");
        assert!(shown.ends_with("...' (1025 bytes)"), "{shown}");
        assert_eq!(
            RuleMatch::Prefix(b"pin_".to_vec()).to_string(),
            "prefix 'pin_'"
        );
    }

    #[test]
    fn given_app_names_when_validated_should_accept_only_the_allowed_alphabet() {
        for good in ["a", "orders-api", "shop_v2.prod", &"a".repeat(128)] {
            assert_eq!(validate_app_name(good), Ok(()), "{good}");
        }
        for bad in ["", "has space", "slash/", "ünicode", &"a".repeat(129)] {
            assert!(validate_app_name(bad).is_err(), "{bad}");
        }
    }
}
