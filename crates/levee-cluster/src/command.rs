//! [`MetaCommand`]: one entry of the metadata log; [`MetaResponse`]: what applying it
//! answered; [`NodeInfo`]: a member's addresses, as the membership keeps them.
//! [`HotKeyMeta`]: the hot-key settings the log carries (rules per app, manual hot keys).

use levee_broker::catalog::{CatalogCommand, CatalogError, CatalogRecord};
use levee_proto::json::RuleRecord;
use serde::{Deserialize, Serialize};

/// A change to the replicated metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MetaCommand {
    /// A change of the broker's catalog (topics, rates, retention rules).
    Catalog(CatalogCommand),
    /// The catalog a data dir kept before the cluster (its `\0meta` queue), as records, applied
    /// once into an empty catalog when a node first starts on it.
    Import(Vec<CatalogRecord>),
    /// Replaces an app's hot-key rules (validated by the node that took the request).
    SetHotKeyRules {
        /// The app.
        app: String,
        /// Its rules, in order.
        rules: Vec<RuleRecord>,
    },
    /// Sets a key hot by hand until an absolute time.
    SetManualHotKey {
        /// The app.
        app: String,
        /// The key.
        key: Vec<u8>,
        /// Until when, in Unix milliseconds (the taking node's clock plus the duration asked).
        expires_at_ms: u64,
        /// The taking node's clock when it took the request: entries that expired before it are
        /// dropped as this command is applied.
        now_ms: u64,
    },
    /// Sets a limits resource's budget (docs/LIMITS.md): `permits` per `period_ms`.
    SetLimitRule {
        /// The resource.
        resource: String,
        /// Permits per period.
        permits: u64,
        /// The period, in milliseconds.
        period_ms: u64,
        /// The rule's per-key limits, breaker and adaptive budget: the `levee.v1.LimitRule`
        /// message as protobuf (validated by the taking node); empty for a plain budget. Logs
        /// written before it existed read as empty.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        policy: Vec<u8>,
    },
    /// Removes a limits resource's rule.
    DeleteLimitRule {
        /// The resource.
        resource: String,
    },
    /// Fixes the cluster's number of shards (docs/CLUSTER.md, "Part 2"): applied once, by the
    /// first node; a later one with another number is refused (the number never changes).
    InitShards {
        /// Shards, 1 to `levee_proto::shards::SHARDS_MAX`.
        shards: u32,
        /// Whether the cluster replicates its plain queues over the shards (docs/CLUSTER.md,
        /// "Part 2", step 2). Logs written before it existed read as false.
        #[serde(default)]
        replicated: bool,
    },
    /// Cools a key by hand (a manual key is forgotten; a detected one cools on every node).
    RemoveHotKey {
        /// The app.
        app: String,
        /// The key.
        key: Vec<u8>,
        /// The taking node's clock when it took the request.
        now_ms: u64,
    },
}

/// What applying one entry did. Entries that carry no command (blank and membership entries)
/// answer the default: nothing changed, nothing refused.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MetaResponse {
    /// Whether the command changed the state (false for a repeat, such as a topic created
    /// again with its count).
    pub changed: bool,
    /// Why the command was refused, if it was; nothing changed then.
    pub refused: Option<CatalogError>,
    /// Why a hot-key or limits command was refused (a bound of the replicated state), if it
    /// was; nothing changed then.
    #[serde(default)]
    pub refused_at_bound: Option<String>,
}

/// A member of the cluster as the membership records it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Its gRPC API address.
    pub grpc_addr: String,
    /// Its admin HTTP address.
    pub admin_addr: String,
    /// The address its peers reach it at.
    pub peer_addr: String,
}

/// Most manual hot keys the cluster keeps at once (over every app); a command that would keep
/// more is refused.
pub const MANUAL_HOT_KEYS_MAX: usize = 100_000;

/// The hot-key settings an operator makes, replicated: every app's rules, and the keys set hot
/// by hand with their expiry (Unix milliseconds).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HotKeyMeta {
    /// Every app's rules, by app.
    pub rules: std::collections::BTreeMap<String, Vec<RuleRecord>>,
    /// Manual hot keys: (app, key) to expiry. In JSON (snapshots) a list of
    /// `[app, key, expiry]`, since JSON keys are strings.
    #[serde(with = "manual_as_list")]
    pub manual: std::collections::BTreeMap<(String, Vec<u8>), u64>,
}

/// The manual hot keys as a list in JSON.
mod manual_as_list {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    type Manual = BTreeMap<(String, Vec<u8>), u64>;

    pub fn serialize<S: Serializer>(manual: &Manual, serializer: S) -> Result<S::Ok, S::Error> {
        let list: Vec<(&String, &Vec<u8>, u64)> = manual
            .iter()
            .map(|((app, key), expiry)| (app, key, *expiry))
            .collect();
        list.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Manual, D::Error> {
        let list: Vec<(String, Vec<u8>, u64)> = Vec::deserialize(deserializer)?;
        Ok(list
            .into_iter()
            .map(|(app, key, expiry)| ((app, key), expiry))
            .collect())
    }
}

impl HotKeyMeta {
    /// Applies a hot-key command; `None` for the other commands.
    pub fn apply(&mut self, command: &MetaCommand) -> Option<MetaResponse> {
        let response = match command {
            MetaCommand::SetHotKeyRules { app, rules } => {
                let changed = self.rules.get(app) != Some(rules);
                self.rules.insert(app.clone(), rules.clone());
                MetaResponse {
                    changed,
                    ..MetaResponse::default()
                }
            }
            MetaCommand::SetManualHotKey {
                app,
                key,
                expires_at_ms,
                now_ms,
            } => {
                self.manual.retain(|_, expiry| *expiry > *now_ms);
                let entry = (app.clone(), key.clone());
                if !self.manual.contains_key(&entry) && self.manual.len() >= MANUAL_HOT_KEYS_MAX {
                    return Some(MetaResponse {
                        refused_at_bound: Some(format!(
                            "the cluster keeps at most {MANUAL_HOT_KEYS_MAX} keys set hot by \
                             hand; remove some, or set them for a shorter time"
                        )),
                        ..MetaResponse::default()
                    });
                }
                let changed = self.manual.insert(entry, *expires_at_ms) != Some(*expires_at_ms);
                MetaResponse {
                    changed,
                    ..MetaResponse::default()
                }
            }
            MetaCommand::RemoveHotKey { app, key, now_ms } => {
                self.manual.retain(|_, expiry| *expiry > *now_ms);
                let changed = self.manual.remove(&(app.clone(), key.clone())).is_some();
                MetaResponse {
                    changed,
                    ..MetaResponse::default()
                }
            }
            MetaCommand::Catalog(_)
            | MetaCommand::Import(_)
            | MetaCommand::InitShards { .. }
            | MetaCommand::SetLimitRule { .. }
            | MetaCommand::DeleteLimitRule { .. } => return None,
        };
        Some(response)
    }
}

/// Told of every hot-key change as the state machine applies it (on every node, in log order,
/// and again on replay after a restart), so that the node's hot-key engines follow the
/// replicated settings. Calls must not block for long: they run inside the apply.
pub trait HotKeyObserver: Send + Sync + std::fmt::Debug {
    /// The app's rules are now `rules`.
    fn rules(&self, app: &str, rules: &[RuleRecord]);
    /// The key is hot by hand until `expires_at_ms` (Unix milliseconds).
    fn manual_hot(&self, app: &str, key: &[u8], expires_at_ms: u64);
    /// The key was cooled by hand.
    fn cooled(&self, app: &str, key: &[u8]);
    /// The whole state was replaced (a snapshot): every app's rules and manual key now.
    fn reset(&self, meta: &HotKeyMeta);
}

/// Most limits resources the cluster keeps.
pub const LIMIT_RULES_MAX: usize = 10_000;

/// The limits rules (docs/LIMITS.md), replicated: each resource's budget as
/// (permits, period in milliseconds).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LimitMeta {
    /// Every resource's rule, by name.
    pub rules: std::collections::BTreeMap<String, (u64, u64)>,
    /// The rules with per-key limits, a breaker or an adaptive budget: their `LimitRule`
    /// messages as protobuf, by name (snapshots taken before it existed read as none).
    #[serde(default)]
    pub policies: std::collections::BTreeMap<String, Vec<u8>>,
}

impl LimitMeta {
    /// Applies a limits command; `None` for the other commands.
    pub fn apply(&mut self, command: &MetaCommand) -> Option<MetaResponse> {
        let response = match command {
            MetaCommand::SetLimitRule {
                resource,
                permits,
                period_ms,
                policy,
            } => {
                if !self.rules.contains_key(resource) && self.rules.len() >= LIMIT_RULES_MAX {
                    return Some(MetaResponse {
                        refused_at_bound: Some(format!(
                            "the cluster keeps at most {LIMIT_RULES_MAX} limits resources; \
                             delete unused ones first"
                        )),
                        ..MetaResponse::default()
                    });
                }
                let rule = (*permits, *period_ms);
                let mut changed = self.rules.insert(resource.clone(), rule) != Some(rule);
                let previous = if policy.is_empty() {
                    self.policies.remove(resource)
                } else {
                    self.policies.insert(resource.clone(), policy.clone())
                };
                changed |= previous.as_deref().unwrap_or_default() != policy.as_slice();
                MetaResponse {
                    changed,
                    ..MetaResponse::default()
                }
            }
            MetaCommand::DeleteLimitRule { resource } => {
                self.policies.remove(resource);
                MetaResponse {
                    changed: self.rules.remove(resource).is_some(),
                    ..MetaResponse::default()
                }
            }
            _ => return None,
        };
        Some(response)
    }
}
