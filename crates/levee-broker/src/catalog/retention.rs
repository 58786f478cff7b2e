//! Retention rules: by queue-name prefix, how old and how large a user's queue may grow. The
//! rule of a queue is that of the longest prefix of its name that has one.

use std::collections::BTreeMap;

use crate::names::NAME_PREFIX_BYTES_MAX;

/// Most retention rules.
pub const RETENTION_RULES_MAX: usize = 10_000;

/// A retention rule's bounds (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct RetentionRule {
    /// Remove messages older than this.
    pub max_age_ms: u64,
    /// Remove the oldest messages while the queue holds more than this.
    pub max_bytes: u64,
}

impl RetentionRule {
    /// Whether the rule bounds nothing (setting it removes a prefix's rule).
    pub fn is_none(self) -> bool {
        self == Self::default()
    }

    /// As the store's retention.
    pub fn to_store(self) -> levee_store::Retention {
        levee_store::Retention {
            max_age_ms: (self.max_age_ms > 0).then_some(self.max_age_ms),
            max_bytes: (self.max_bytes > 0).then_some(self.max_bytes),
            before_offset: None,
        }
    }
}

/// Every retention rule, by prefix.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RetentionRules {
    by_prefix: BTreeMap<Vec<u8>, RetentionRule>,
}

impl RetentionRules {
    /// The rule of the longest prefix of `queue` (the default when none matches).
    pub fn rule_for(&self, queue: &[u8]) -> RetentionRule {
        // Longest first: walk the candidate prefixes of the name from the whole name down.
        (0..=queue.len().min(NAME_PREFIX_BYTES_MAX))
            .rev()
            .find_map(|length| self.by_prefix.get(&queue[..length]).copied())
            .unwrap_or_default()
    }

    /// Whether `prefix` has a rule.
    pub fn contains(&self, prefix: &[u8]) -> bool {
        self.by_prefix.contains_key(prefix)
    }

    /// How many rules there are.
    pub fn len(&self) -> usize {
        self.by_prefix.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.by_prefix.is_empty()
    }

    /// Every rule, by prefix.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], RetentionRule)> {
        self.by_prefix
            .iter()
            .map(|(prefix, rule)| (prefix.as_slice(), *rule))
    }

    /// Sets `prefix`'s rule; a rule that bounds nothing removes it.
    pub(crate) fn set(&mut self, prefix: Vec<u8>, rule: RetentionRule) {
        if rule.is_none() {
            self.by_prefix.remove(&prefix);
        } else {
            self.by_prefix.insert(prefix, rule);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_nested_prefixes_then_the_longest_match_wins() {
        let mut rules = RetentionRules::default();
        let short = RetentionRule {
            max_age_ms: 1,
            max_bytes: 0,
        };
        let long = RetentionRule {
            max_age_ms: 0,
            max_bytes: 2,
        };
        rules.set(b"driver-".to_vec(), short);
        rules.set(b"driver-7".to_vec(), long);
        assert_eq!(rules.rule_for(b"driver-77"), long);
        assert_eq!(rules.rule_for(b"driver-8"), short);
        assert_eq!(rules.rule_for(b"rider"), RetentionRule::default());
        rules.set(b"driver-7".to_vec(), RetentionRule::default());
        assert_eq!(rules.rule_for(b"driver-77"), short);
        assert_eq!(rules.len(), 1);
    }
}
