//! The JSON forms of API messages that the admin HTTP port answers and the CLI prints, in one
//! place so both speak the same form: keys as text or hex, hot-key rules ([`RuleRecord`], also
//! the rules file in the data dir), a group's and a producer name's description.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::v1::{
    DescribeGroupResponse, DescribeProducerResponse, DescribeRetryPolicyResponse, HotKeyRule,
    ListDeadLettersResponse, MatchKind, ResetGroupOffsetsResponse,
};

/// A key for JSON: the text when it is UTF-8, otherwise `None` (then see [`key_hex`]).
pub fn key_text(key: &[u8]) -> Option<&str> {
    std::str::from_utf8(key).ok()
}

/// A key in lowercase hexadecimal, for keys that are not UTF-8.
pub fn key_hex(key: &[u8]) -> String {
    use std::fmt::Write;
    key.iter()
        .fold(String::with_capacity(key.len() * 2), |mut text, byte| {
            let _ = write!(text, "{byte:02x}");
            text
        })
}

/// Parses lowercase or uppercase hexadecimal into bytes.
pub fn key_from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|index| u8::from_str_radix(text.get(index..index + 2)?, 16).ok())
        .collect()
}

/// One hot-key rule in JSON. A key that is not UTF-8 travels as `key_hex`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleRecord {
    /// `exact`, `prefix` or `default`.
    #[serde(rename = "match")]
    pub match_kind: String,
    /// The key or prefix, as text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The key or prefix, in hexadecimal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_hex: Option<String>,
    /// The window in milliseconds.
    pub window_ms: u32,
    /// Hits within the window that make a key hot.
    pub threshold: u64,
    /// How long a hot key stays hot, in milliseconds.
    pub hot_duration_ms: u64,
    /// For people.
    #[serde(default)]
    pub description: String,
}

impl RuleRecord {
    /// The JSON form of a wire rule (an unknown match kind reads as `default`'s number).
    pub fn from_wire(rule: &HotKeyRule) -> Self {
        let match_kind = match MatchKind::try_from(rule.match_kind) {
            Ok(MatchKind::Exact) => "exact",
            Ok(MatchKind::Prefix) => "prefix",
            Ok(MatchKind::Default | MatchKind::Unspecified) | Err(_) => "default",
        };
        let keyed = match_kind != "default";
        let (key, key_hex) = match (keyed, key_text(&rule.key)) {
            (false, _) => (None, None),
            (true, Some(text)) => (Some(text.to_owned()), None),
            (true, None) => (None, Some(self::key_hex(&rule.key))),
        };
        Self {
            match_kind: match_kind.to_owned(),
            key,
            key_hex,
            window_ms: rule.window_ms,
            threshold: rule.threshold,
            hot_duration_ms: rule.hot_duration_ms,
            description: rule.description.clone(),
        }
    }

    /// The wire rule this JSON describes; the server's engine validates the ranges.
    pub fn to_wire(&self) -> Result<HotKeyRule, String> {
        let key = match (&self.key, &self.key_hex) {
            (Some(text), None) => Some(text.as_bytes().to_vec()),
            (None, Some(hex)) => Some(
                key_from_hex(hex)
                    .ok_or_else(|| format!("key_hex '{hex}' is not an even-length hex string"))?,
            ),
            (None, None) => None,
            (Some(_), Some(_)) => return Err("give key or key_hex, not both".to_owned()),
        };
        let (match_kind, key) = match (self.match_kind.as_str(), key) {
            ("exact", Some(key)) => (MatchKind::Exact, key),
            ("prefix", Some(key)) => (MatchKind::Prefix, key),
            ("default" | "*", None) => (MatchKind::Default, Vec::new()),
            ("exact" | "prefix", None) => {
                return Err(format!(
                    "a '{}' rule needs a key (or key_hex)",
                    self.match_kind
                ));
            }
            ("default" | "*", Some(_)) => return Err("a 'default' rule takes no key".to_owned()),
            (other, _) => {
                return Err(format!(
                    "match must be exact, prefix or default, got '{other}'"
                ));
            }
        };
        Ok(HotKeyRule {
            match_kind: match_kind as i32,
            key,
            window_ms: self.window_ms,
            threshold: self.threshold,
            hot_duration_ms: self.hot_duration_ms,
            description: self.description.clone(),
        })
    }
}

/// A group's description as JSON, with each partition's lag.
pub fn group_json(described: &DescribeGroupResponse) -> Value {
    let members: Vec<Value> = described
        .members
        .iter()
        .map(|member| {
            json!({
                "member": member.member,
                "partitions": member.partitions,
                "lease_left_ms": member.lease_left_ms,
            })
        })
        .collect();
    let partitions: Vec<Value> = described
        .partitions
        .iter()
        .map(|partition| {
            json!({
                "partition": partition.partition,
                "owner": partition.owner,
                "epoch": partition.epoch,
                "committed_offset": partition.committed_offset,
                "next_offset": partition.next_offset,
                "lag": partition.next_offset.saturating_sub(partition.committed_offset),
                "retry_committed_offset": partition.retry_committed_offset,
                "retry_next_offset": partition.retry_next_offset,
                "retries_due": partition
                    .retry_next_offset
                    .saturating_sub(partition.retry_committed_offset),
            })
        })
        .collect();
    json!({
        "group": described.group,
        "topic": described.topic,
        "generation": described.generation,
        "members": members,
        "partitions": partitions,
        "rate_limit_per_s": described.rate_limit_per_s,
        "delivered": described.delivered,
        "throttled_s": described.throttled_s,
        "retries_scheduled": described.retries_scheduled,
        "dead_lettered": described.dead_lettered,
        "redriven": described.redriven,
    })
}

/// A group's retry policy as JSON.
pub fn retry_policy_json(described: &DescribeRetryPolicyResponse) -> Value {
    json!({
        "group": described.group,
        "delays_ms": described.delays_ms,
        "max_attempts": described.max_attempts,
        "is_default": described.is_default,
    })
}

/// A page of dead letters as JSON: each payload as `payload` (text) or `payload_hex`.
pub fn dead_letters_json(page: &ListDeadLettersResponse) -> Value {
    let letters: Vec<Value> = page
        .dead_letters
        .iter()
        .map(|letter| {
            let history: Vec<Value> = letter
                .history
                .iter()
                .map(|failure| json!({"at_ms": failure.at_ms, "error": failure.error}))
                .collect();
            let mut value = json!({
                "offset": letter.offset,
                "partition": letter.partition,
                "original_offset": letter.original_offset,
                "attempts": letter.attempts,
                "dead_at_ms": letter.dead_at_ms,
                "history": history,
            });
            match key_text(&letter.payload) {
                Some(text) => value["payload"] = json!(text),
                None => value["payload_hex"] = json!(key_hex(&letter.payload)),
            }
            value
        })
        .collect();
    json!({
        "dead_letters": letters,
        "next_offset": page.next_offset,
        "end_offset": page.end_offset,
    })
}

/// An offset reset's answer as JSON.
pub fn reset_json(reset: &ResetGroupOffsetsResponse) -> Value {
    let partitions: Vec<Value> = reset
        .partitions
        .iter()
        .map(|partition| {
            json!({
                "partition": partition.partition,
                "committed_offset": partition.committed_offset,
                "first_offset": partition.first_offset,
                "before_retention": partition.before_retention,
            })
        })
        .collect();
    json!({"partitions": partitions, "members_fenced": reset.members_fenced})
}

/// A producer name's limit and figures as JSON.
pub fn producer_json(described: &DescribeProducerResponse) -> Value {
    json!({
        "producer_name": described.producer_name,
        "messages_per_s": described.rate_limit_per_s,
        "admitted": described.admitted,
        "throttled_s": described.throttled_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_binary_key_then_hex_round_trips() {
        let key = vec![0, 255, 16, 7];
        assert_eq!(key_hex(&key), "00ff1007");
        assert_eq!(key_from_hex("00FF1007").unwrap(), key);
        assert!(key_from_hex("abc").is_none());
        assert!(key_from_hex("zz").is_none());
    }

    #[test]
    fn given_rule_records_then_they_round_trip_through_the_wire_and_bad_ones_say_why() {
        let record = RuleRecord {
            match_kind: "prefix".to_owned(),
            key: None,
            key_hex: Some("00ff".to_owned()),
            window_ms: 2_000,
            threshold: 20,
            hot_duration_ms: 30_000,
            description: "hot users".to_owned(),
        };
        assert_eq!(RuleRecord::from_wire(&record.to_wire().unwrap()), record);
        let default = RuleRecord {
            match_kind: "*".to_owned(),
            key_hex: None,
            ..record.clone()
        };
        assert_eq!(
            RuleRecord::from_wire(&default.to_wire().unwrap()).match_kind,
            "default"
        );
        let mut bad = record.clone();
        bad.match_kind = "regex".to_owned();
        assert!(bad.to_wire().unwrap_err().contains("got 'regex'"));
        bad.match_kind = "exact".to_owned();
        bad.key_hex = None;
        assert!(bad.to_wire().unwrap_err().contains("needs a key"));
    }
}
