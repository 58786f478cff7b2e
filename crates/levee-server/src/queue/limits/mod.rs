//! Flow control enforced on the server's streams and appends; the limits themselves are set
//! through the broker's catalog (logged, replayed on start) and their pacing is the broker's
//! token bucket. It owns:
//!
//! - `group_rate`: each consumer group's delivery pacer and its figures;
//! - `producer_rate`: each producer name's append admission (requests held in order, refused
//!   past the longest wait) and its figures.

pub mod group_rate;
pub mod producer_rate;

use std::collections::BTreeMap;
use std::sync::Arc;

use levee_cluster::network::RaftMetrics;
use tokio::sync::watch;

use crate::queue::topic::consume::ConsumeContext;

/// Keeps the pacers and producer limits equal to the catalog this node has applied, whichever
/// node took the change (docs/CLUSTER.md: a change is in force on every node within one
/// commit), until `stop` turns true. `metrics` says when the state machine applied more.
pub async fn follow_catalog(
    context: Arc<ConsumeContext>,
    mut metrics: watch::Receiver<RaftMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let (mut groups, mut producers) = context.topics.rates();
    let mut applied = metrics.borrow_and_update().last_applied;
    loop {
        tokio::select! {
            changed = metrics.changed() => if changed.is_err() { return },
            _ = stop.wait_for(|stop| *stop) => return,
        }
        let now = metrics.borrow_and_update().last_applied;
        if now == applied {
            continue;
        }
        applied = now;
        let (new_groups, new_producers) = context.topics.rates();
        enforce_changes(&groups, &new_groups, |group, rate| {
            context.pacers.set(group, rate);
        });
        enforce_changes(&producers, &new_producers, |name, rate| {
            context.producer_rates.set(name, rate);
        });
        (groups, producers) = (new_groups, new_producers);
    }
}

/// Calls `set` for every rate that differs between `old` and `new` (0 for one cleared).
fn enforce_changes(
    old: &BTreeMap<String, f64>,
    new: &BTreeMap<String, f64>,
    mut set: impl FnMut(&str, f64),
) {
    for (name, rate) in new {
        if old.get(name) != Some(rate) {
            set(name, *rate);
        }
    }
    for name in old.keys().filter(|name| !new.contains_key(*name)) {
        set(name, 0.0);
    }
}
