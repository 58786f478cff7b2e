//! Conversions between the hot-key engine's types and the `levee.v1` wire types.

use levee_hotkey::{Event, HotEvent, HotSource, Rule, RuleMatch};
use levee_proto::WireError;
use levee_proto::json::RuleRecord;
use levee_proto::v1::{ErrorCode, HotKeyEvent, HotKeyRule, HotKeySource, MatchKind};

use super::clock::Clock;

/// A wire rule as an engine rule; the engine validates the ranges.
pub fn rule_from_wire(rule: &HotKeyRule) -> Result<Rule, WireError> {
    let matcher = match MatchKind::try_from(rule.match_kind) {
        Ok(MatchKind::Exact) => RuleMatch::Exact(rule.key.clone()),
        Ok(MatchKind::Prefix) => RuleMatch::Prefix(rule.key.clone()),
        Ok(MatchKind::Default) => RuleMatch::Default,
        Ok(MatchKind::Unspecified) | Err(_) => {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "rule for key {}: match_kind must be EXACT, PREFIX or DEFAULT, got {}",
                    levee_hotkey::rule::quoted_key(&rule.key),
                    rule.match_kind
                ),
            ));
        }
    };
    Ok(Rule {
        matcher,
        window_ms: rule.window_ms,
        threshold: rule.threshold,
        hot_duration_ms: rule.hot_duration_ms,
        description: rule.description.clone(),
    })
}

/// An engine rule on the wire.
pub fn rule_to_wire(rule: &Rule) -> HotKeyRule {
    let (match_kind, key) = match &rule.matcher {
        RuleMatch::Exact(key) => (MatchKind::Exact, key.clone()),
        RuleMatch::Prefix(prefix) => (MatchKind::Prefix, prefix.clone()),
        RuleMatch::Default => (MatchKind::Default, Vec::new()),
    };
    HotKeyRule {
        match_kind: match_kind as i32,
        key,
        window_ms: rule.window_ms,
        threshold: rule.threshold,
        hot_duration_ms: rule.hot_duration_ms,
        description: rule.description.clone(),
    }
}

/// A hot event on the wire, its remaining time measured from `now_ms`.
pub fn hot_to_wire(hot: &HotEvent, rule: Option<&Rule>, clock: &Clock, now_ms: u64) -> HotKeyEvent {
    HotKeyEvent {
        hot: true,
        app: hot.app.clone(),
        key: hot.key.clone(),
        rule: rule.map(rule_to_wire).or_else(|| {
            Some(HotKeyRule {
                match_kind: match &hot.rule {
                    RuleMatch::Exact(_) => MatchKind::Exact,
                    RuleMatch::Prefix(_) => MatchKind::Prefix,
                    RuleMatch::Default => MatchKind::Default,
                } as i32,
                key: match &hot.rule {
                    RuleMatch::Exact(key) | RuleMatch::Prefix(key) => key.clone(),
                    RuleMatch::Default => Vec::new(),
                },
                ..HotKeyRule::default()
            })
        }),
        count: hot.count,
        hot_for_ms: hot.hot_until_ms.saturating_sub(now_ms),
        hot_until_unix_ms: clock.to_unix_ms(hot.hot_until_ms),
        source: match hot.source {
            HotSource::Detected => HotKeySource::Detected,
            HotSource::Manual => HotKeySource::Manual,
        } as i32,
    }
}

/// An engine event on the wire.
pub fn event_to_wire(event: &Event, clock: &Clock, now_ms: u64) -> HotKeyEvent {
    match event {
        Event::Hot(hot) => hot_to_wire(hot, None, clock, now_ms),
        Event::Cool { app, key } => HotKeyEvent {
            hot: false,
            app: app.clone(),
            key: key.clone(),
            ..HotKeyEvent::default()
        },
    }
}

/// A rule in the JSON form of the admin API and the rules file.
pub fn rule_to_record(rule: &Rule) -> RuleRecord {
    RuleRecord::from_wire(&rule_to_wire(rule))
}

/// The rule a JSON record describes; the engine validates the ranges.
pub fn rule_from_record(record: &RuleRecord) -> Result<Rule, String> {
    let wire = record.to_wire()?;
    rule_from_wire(&wire).map_err(|error| error.message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_rule_when_sent_and_read_back_then_same() {
        let rule = Rule {
            matcher: RuleMatch::Prefix(b"pin_".to_vec()),
            window_ms: 2_000,
            threshold: 20,
            hot_duration_ms: 30_000,
            description: "hot users".to_owned(),
        };
        assert_eq!(rule_from_wire(&rule_to_wire(&rule)).unwrap(), rule);
        let unspecified = HotKeyRule {
            match_kind: 0,
            ..rule_to_wire(&rule)
        };
        let error = rule_from_wire(&unspecified).unwrap_err();
        assert!(error.message.contains("match_kind must be"), "{error}");
    }
}
