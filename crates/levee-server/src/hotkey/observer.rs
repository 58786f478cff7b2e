//! [`HubObserver`]: the node's hot-key engines follow the replicated hot-key settings. The
//! metadata state machine tells it each change as it applies the log (on every node, in log
//! order, and again on replay after a restart), so rules and manual hot keys set through any
//! node are in force on every node once applied there.

use std::sync::Arc;

use levee_cluster::{HotKeyMeta, HotKeyObserver};
use levee_proto::json::RuleRecord;

use super::convert::rule_from_record;
use super::hub::HotKeyHub;

/// Applies replicated hot-key settings to a [`HotKeyHub`].
#[derive(Debug, Clone)]
pub struct HubObserver(pub Arc<HotKeyHub>);

impl HotKeyObserver for HubObserver {
    fn rules(&self, app: &str, rules: &[RuleRecord]) {
        let converted: Result<Vec<_>, _> = rules.iter().map(rule_from_record).collect();
        let applied = converted.and_then(|rules| {
            self.0
                .set_rules(app, rules)
                .map_err(|error| error.message.clone())
        });
        if let Err(message) = applied {
            // Rules are checked before they are written: a refusal here means this node runs
            // a version with other bounds than the one that took the change.
            tracing::error!(app, %message, "replicated hot-key rules refused by this node");
        }
    }

    fn manual_hot(&self, app: &str, key: &[u8], expires_at_ms: u64) {
        if let Err(error) = self.0.set_manual_hot_until(app, key, expires_at_ms) {
            tracing::warn!(app, message = %error.message, "a manual hot key not set on this node");
        }
    }

    fn cooled(&self, app: &str, key: &[u8]) {
        self.0.remove_hot(app, key);
    }

    fn reset(&self, meta: &HotKeyMeta) {
        for (app, rules) in &meta.rules {
            self.rules(app, rules);
        }
        for ((app, key), expires_at_ms) in &meta.manual {
            self.manual_hot(app, key, *expires_at_ms);
        }
    }
}
