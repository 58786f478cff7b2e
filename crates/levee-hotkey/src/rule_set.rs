//! [`RuleSet`]: an app's validated rules, compiled for matching (exact key, then the longest
//! prefix, then `*`) and for counting (slot length and admission threshold per rule).

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::rule::{RULES_PER_APP_MAX, Rule, RuleError, RuleMatch};
use crate::window::slot_ms;

/// Largest admission: sketch cells are `u32`, so admissions stay well below where they
/// saturate (a saturated estimate only admits a key early, never late).
pub const ADMISSION_MAX: u64 = 1 << 31;

/// A rule with what counting needs, computed once.
#[derive(Debug, Clone)]
pub struct CompiledRule {
    /// The rule as given.
    pub rule: Rule,
    /// Its window, in ms.
    pub window_ms: u64,
    /// Its slot length, in ms.
    pub slot_ms: u64,
    /// The sketch estimate at which a key of this rule gets an exact window.
    pub admission: u64,
}

/// An app's rules, ready for matching.
#[derive(Debug, Clone, Default)]
pub struct RuleSet {
    rules: Vec<CompiledRule>,
    exact: HashMap<Box<[u8]>, u32, RandomState>,
    prefixes: HashMap<Box<[u8]>, u32, RandomState>,
    /// The distinct prefix lengths, longest first.
    prefix_lengths: Vec<usize>,
    default: Option<u32>,
}

impl RuleSet {
    /// Validates and compiles `rules` for `app`.
    pub fn new(
        app: &str,
        rules: Vec<Rule>,
        key_bytes_max: usize,
        admission_divisor: u64,
    ) -> Result<Self, RuleError> {
        if rules.len() > RULES_PER_APP_MAX {
            return Err(RuleError::TooMany {
                app: app.to_owned(),
                max: RULES_PER_APP_MAX,
                got: rules.len(),
            });
        }
        let mut set = Self::default();
        for rule in rules {
            rule.validate_with_key_bytes_max(key_bytes_max)?;
            // At most RULES_PER_APP_MAX rules, so the index fits in u32.
            let index = u32::try_from(set.rules.len()).unwrap_or(u32::MAX);
            let duplicate = match &rule.matcher {
                RuleMatch::Exact(key) => set.exact.insert(key.clone().into(), index).is_some(),
                RuleMatch::Prefix(prefix) => {
                    if !set.prefix_lengths.contains(&prefix.len()) {
                        set.prefix_lengths.push(prefix.len());
                    }
                    set.prefixes.insert(prefix.clone().into(), index).is_some()
                }
                RuleMatch::Default => set.default.replace(index).is_some(),
            };
            if duplicate {
                return Err(RuleError::Duplicate {
                    rule: rule.matcher.to_string(),
                });
            }
            let window_ms = u64::from(rule.window_ms);
            set.rules.push(CompiledRule {
                window_ms,
                slot_ms: slot_ms(window_ms),
                admission: (rule.threshold / admission_divisor.max(1)).clamp(1, ADMISSION_MAX),
                rule,
            });
        }
        set.prefix_lengths
            .sort_unstable_by(|left, right| right.cmp(left));
        Ok(set)
    }

    /// The index of the rule that applies to `key`, if any.
    #[inline]
    pub fn find(&self, key: &[u8]) -> Option<u32> {
        if !self.exact.is_empty()
            && let Some(&index) = self.exact.get(key)
        {
            return Some(index);
        }
        for &length in &self.prefix_lengths {
            if length <= key.len()
                && let Some(&index) = self.prefixes.get(&key[..length])
            {
                return Some(index);
            }
        }
        self.default
    }

    /// The compiled rule at `index` (from [`RuleSet::find`]).
    #[inline]
    pub fn get(&self, index: u32) -> &CompiledRule {
        // Indices come from `find` on this same set; usize holds every u32 on our targets.
        &self.rules[usize::try_from(index).unwrap_or(usize::MAX)]
    }

    /// The rules as given.
    pub fn rules(&self) -> Vec<Rule> {
        self.rules
            .iter()
            .map(|compiled| compiled.rule.clone())
            .collect()
    }

    /// The longest window of the rules, in ms (0 with no rules).
    pub fn window_ms_max(&self) -> u64 {
        self.rules
            .iter()
            .map(|compiled| compiled.window_ms)
            .max()
            .unwrap_or(0)
    }

    /// Estimated bytes held.
    pub fn bytes(&self) -> usize {
        let per_rule = std::mem::size_of::<CompiledRule>() + 2 * std::mem::size_of::<usize>() + 16;
        self.rules
            .iter()
            .map(|compiled| {
                per_rule
                    + compiled.rule.description.len()
                    + 2 * match &compiled.rule.matcher {
                        RuleMatch::Exact(key) | RuleMatch::Prefix(key) => key.len(),
                        RuleMatch::Default => 0,
                    }
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(matcher: RuleMatch, threshold: u64) -> Rule {
        Rule {
            matcher,
            threshold,
            ..Rule::default_rule()
        }
    }

    fn exact(key: &str) -> RuleMatch {
        RuleMatch::Exact(key.as_bytes().to_vec())
    }

    fn prefix(key: &str) -> RuleMatch {
        RuleMatch::Prefix(key.as_bytes().to_vec())
    }

    #[test]
    fn given_exact_prefixes_and_default_when_matched_should_prefer_exact_then_longest_prefix() {
        let set = RuleSet::new(
            "app",
            vec![
                rule(prefix("pin_"), 1),
                rule(RuleMatch::Default, 2),
                rule(prefix("pin_vip_"), 3),
                rule(exact("pin_vip_ceo"), 4),
                rule(prefix("p"), 5),
            ],
            1_024,
            8,
        )
        .unwrap();
        let threshold = |key: &str| {
            set.find(key.as_bytes())
                .map(|index| set.get(index).rule.threshold)
        };
        assert_eq!(threshold("pin_vip_ceo"), Some(4));
        assert_eq!(threshold("pin_vip_ceo2"), Some(3));
        assert_eq!(threshold("pin_vip_"), Some(3));
        assert_eq!(threshold("pin_123"), Some(1));
        assert_eq!(threshold("pi"), Some(5));
        assert_eq!(threshold("order_1"), Some(2));
    }

    #[test]
    fn given_no_default_rule_when_key_matches_nothing_should_find_none() {
        let set = RuleSet::new("app", vec![rule(prefix("pin_"), 1)], 1_024, 8).unwrap();
        assert_eq!(set.find(b"order_1"), None);
        assert_eq!(set.find(b"pin"), None);
        assert_eq!(set.find(b"pin_1"), Some(0));
    }

    #[test]
    fn given_duplicate_or_too_many_rules_when_compiled_should_refuse() {
        let error = RuleSet::new(
            "app",
            vec![rule(prefix("a"), 1), rule(prefix("a"), 2)],
            1_024,
            8,
        )
        .unwrap_err();
        assert_eq!(error.to_string(), "rule prefix 'a' appears twice; keep one");
        let many = (0..=RULES_PER_APP_MAX)
            .map(|index| rule(exact(&index.to_string()), 1))
            .collect();
        let error = RuleSet::new("app", many, 1_024, 8).unwrap_err();
        assert!(
            matches!(error, RuleError::TooMany { got: 1_001, .. }),
            "{error}"
        );
    }

    #[test]
    fn given_thresholds_when_compiled_should_set_admission_to_threshold_over_divisor() {
        let set = RuleSet::new(
            "app",
            vec![
                rule(exact("a"), 1),
                rule(exact("b"), 8),
                rule(exact("c"), 17),
                rule(exact("d"), 1_000),
            ],
            1_024,
            8,
        )
        .unwrap();
        let admissions: Vec<u64> = (0..4).map(|index| set.get(index).admission).collect();
        assert_eq!(admissions, [1, 1, 2, 125]);
        let set = RuleSet::new("app", vec![rule(exact("a"), 1_000_000_000_000)], 1_024, 8).unwrap();
        assert_eq!(
            set.get(0).admission,
            ADMISSION_MAX,
            "kept below the sketch cells' range"
        );
    }
}
