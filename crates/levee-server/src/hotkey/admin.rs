//! [`HotKeyAdmin`]: the operator's hot-key calls in a cluster (docs/CLUSTER.md). Rules and
//! manual hot keys are written through the metadata group from any node, so that they are in
//! force on every node (each node's engines follow the log, [`super::observer`]); reads of
//! rules and apps are linearizable. Hot keys found by counting stay each node's own.

use std::sync::Arc;

use levee_cluster::{Manager, MetaCommand, MetaResponse, MetaWriter};
use levee_hotkey::Rule;
use levee_proto::WireError;

use super::convert::rule_to_record;
use super::hub::HotKeyHub;

/// Writes hot-key settings through the metadata group and reads them back.
#[derive(Debug, Clone)]
pub struct HotKeyAdmin {
    hub: Arc<HotKeyHub>,
    writer: MetaWriter,
    manager: Manager,
}

impl HotKeyAdmin {
    /// The admin of `hub`'s settings, written with `writer`.
    pub fn new(hub: Arc<HotKeyHub>, writer: MetaWriter, manager: Manager) -> Self {
        Self {
            hub,
            writer,
            manager,
        }
    }

    /// The hub.
    pub fn hub(&self) -> &Arc<HotKeyHub> {
        &self.hub
    }

    async fn write(&self, command: MetaCommand) -> Result<MetaResponse, WireError> {
        crate::metadata::write(&self.writer, command).await
    }

    async fn linearize(&self) -> Result<(), WireError> {
        crate::metadata::linearize(&self.manager).await
    }

    /// Replaces an app's rules on every node.
    pub async fn set_rules(&self, app: &str, rules: &[Rule]) -> Result<(), WireError> {
        HotKeyHub::check_rules(app, rules)?;
        self.write(MetaCommand::SetHotKeyRules {
            app: app.to_owned(),
            rules: rules.iter().map(rule_to_record).collect(),
        })
        .await
        .map(drop)
    }

    /// An app's rules, linearizable.
    pub async fn rules(&self, app: &str) -> Result<Vec<Rule>, WireError> {
        self.linearize().await?;
        self.hub.rules(app)
    }

    /// The apps, linearizable.
    pub async fn apps(&self) -> Result<Vec<String>, WireError> {
        self.linearize().await?;
        Ok(self.hub.apps())
    }

    /// Sets `key` hot by hand on every node for `duration_ms` from now (this node's clock).
    pub async fn set_manual_hot(
        &self,
        app: &str,
        key: &[u8],
        duration_ms: u64,
    ) -> Result<(), WireError> {
        self.hub.check_manual_hot(app, key, duration_ms)?;
        self.hub.check_app(app)?;
        let now_ms = self.hub.now_unix_ms();
        self.write(MetaCommand::SetManualHotKey {
            app: app.to_owned(),
            key: key.to_vec(),
            expires_at_ms: now_ms.saturating_add(duration_ms),
            now_ms,
        })
        .await
        .map(drop)
    }

    /// Cools `key` on every node; whether it was hot (set by hand, or hot here).
    pub async fn remove_hot(&self, app: &str, key: &[u8]) -> Result<bool, WireError> {
        let hot_here = self.hub.is_hot(app, key);
        let response = self
            .write(MetaCommand::RemoveHotKey {
                app: app.to_owned(),
                key: key.to_vec(),
                now_ms: self.hub.now_unix_ms(),
            })
            .await?;
        Ok(hot_here || response.changed)
    }
}
