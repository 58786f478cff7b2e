//! The hot keys other members count, for rules that limit a hot-key app's hot keys: in a
//! cluster each node counts the keys it owns, so while this node leads the metadata group it
//! asks every other member for the hot keys of each app a rule names (`HotKeys.ListHotKeys`)
//! every lease period. A member's answer stands until it answers again, for at most
//! [`ANSWER_TTL`]; a member that does not answer within [`ASK_TIMEOUT`] keeps its last answer
//! until then.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use levee_cluster::{Manager, MetaStateMachine};
use levee_proto::v1::hot_keys_client::HotKeysClient;
use levee_proto::v1::{LimitRule, ListHotKeysRequest};
use prost::Message;
use tokio::sync::watch;
use tonic::transport::Channel;

use super::policy::HOT_KEYS_MAX;
use crate::cluster_service::channel_to;

/// How often the members are asked (a lease period).
const ASK_INTERVAL: Duration = Duration::from_millis(100);
/// How long one member may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_millis(200);
/// How long an answer stands without a newer one.
pub const ANSWER_TTL: Duration = Duration::from_secs(1);

/// (member address, app) to (when it answered, its hot keys).
type Answers = HashMap<(String, String), (Instant, Vec<Vec<u8>>)>;

/// The hot keys the other members answered last, by app.
#[derive(Debug, Clone, Default)]
pub struct PeerHotKeys {
    answers: Arc<Mutex<Answers>>,
}

impl PeerHotKeys {
    /// The hot keys of `app` the other members answered within [`ANSWER_TTL`].
    pub fn hot_keys(&self, app: &str) -> BTreeSet<Vec<u8>> {
        let answers = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        answers
            .iter()
            .filter(|((_, known), (at, _))| known == app && at.elapsed() < ANSWER_TTL)
            .flat_map(|(_, (_, keys))| keys.iter().cloned())
            .collect()
    }

    /// Asks the other members every [`ASK_INTERVAL`] while this node leads, until `stop`.
    pub fn follow(
        &self,
        machine: MetaStateMachine,
        manager: Manager,
        mut stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let answers = Arc::clone(&self.answers);
        tokio::spawn(async move {
            let mut channels: HashMap<String, Channel> = HashMap::new();
            let mut ticker = tokio::time::interval(ASK_INTERVAL);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = stop.wait_for(|stop| *stop) => return,
                }
                let metrics = manager.raft().metrics().borrow().clone();
                if metrics.current_leader != Some(metrics.id) {
                    continue;
                }
                let apps = hot_key_apps(&machine);
                let peers: Vec<String> = metrics
                    .membership_config
                    .membership()
                    .nodes()
                    .filter(|(id, _)| **id != metrics.id)
                    .map(|(_, node)| node.grpc_addr.clone())
                    .collect();
                channels.retain(|address, _| peers.contains(address));
                let asks = peers.iter().flat_map(|peer| {
                    let channel = channel_to(&mut channels, peer, ASK_TIMEOUT);
                    apps.iter()
                        .map(move |app| ask(channel.clone(), peer.clone(), app.clone()))
                        .collect::<Vec<_>>()
                });
                let answered = futures_util::future::join_all(asks).await;
                let mut known = answers.lock().unwrap_or_else(PoisonError::into_inner);
                known.retain(|(peer, app), (at, _)| {
                    peers.contains(peer) && apps.contains(app) && at.elapsed() < ANSWER_TTL
                });
                for (peer, app, keys) in answered.into_iter().flatten() {
                    known.insert((peer, app), (Instant::now(), keys));
                }
            }
        })
    }
}

/// The hot-key apps the rules name.
fn hot_key_apps(machine: &MetaStateMachine) -> BTreeSet<String> {
    machine.with_limits(|limits| {
        limits
            .policies
            .values()
            .filter_map(|bytes| LimitRule::decode(bytes.as_slice()).ok())
            .filter_map(|rule| rule.per_key)
            .map(|per_key| per_key.hot_key_app)
            .filter(|app| !app.is_empty())
            .collect()
    })
}

/// One member's hot keys of `app`, or `None` if it did not answer in time.
async fn ask(
    channel: Option<Channel>,
    peer: String,
    app: String,
) -> Option<(String, String, Vec<Vec<u8>>)> {
    let mut client = HotKeysClient::new(channel?);
    let call = client.list_hot_keys(ListHotKeysRequest { app: app.clone() });
    let answer = tokio::time::timeout(ASK_TIMEOUT, call).await.ok()?.ok()?;
    let keys = answer
        .into_inner()
        .hot
        .into_iter()
        .take(HOT_KEYS_MAX)
        .map(|event| event.key)
        .collect();
    Some((peer, app, keys))
}
