//! Retention passes over the store: users' queues get the rule of their longest prefix (see
//! the broker's catalog), server-owned log queues (positions, commits, producers' runs) are
//! trimmed to a small size since only their newest records matter, groups' retry queues lose
//! the chunks below the group's committed offset on them, topic partitions are kept.

use levee_broker::names;
use levee_store::Store;

/// Bytes a consumer's position queue keeps when trimmed: every ack appends one small record,
/// so the queue is trimmed from the front down to this size (its last chunk, which holds the
/// newest position, is far smaller and always stays).
pub const POSITION_QUEUE_BYTES_MAX: u64 = 64 << 10;
/// How often position queues are trimmed.
pub const POSITION_TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Trims every server-owned log queue (consumer positions, group commits, idempotent
/// producers' runs) to about [`POSITION_QUEUE_BYTES_MAX`]; only their newest records matter.
/// Other queues are left alone. Blocks on the store: call it on the blocking pool.
#[cfg(test)]
pub fn trim_positions(store: &Store, now_ms: u64) -> Result<u64, levee_store::WriteError> {
    enforce_retention(
        store,
        now_ms,
        |_| levee_store::Retention::default(),
        |_| None,
    )
}

/// One retention pass: server-owned log queues are trimmed to about
/// [`POSITION_QUEUE_BYTES_MAX`], a group's retry queue below `done_below(name)` (its committed
/// offset, when the group is loaded), topic partitions are kept, and every other queue gets
/// `rule(name)`. Returns the messages removed. Blocks on the store: call it on the blocking
/// pool.
pub fn enforce_retention(
    store: &Store,
    now_ms: u64,
    rule: impl Fn(&[u8]) -> levee_store::Retention,
    done_below: impl Fn(&[u8]) -> Option<u64>,
) -> Result<u64, levee_store::WriteError> {
    let report = store.enforce_retention(now_ms, |name| {
        if names::LOG_QUEUE_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
        {
            levee_store::Retention {
                max_age_ms: None,
                max_bytes: Some(POSITION_QUEUE_BYTES_MAX),
                before_offset: None,
            }
        } else if name.starts_with(names::RETRY_PREFIX) {
            levee_store::Retention {
                before_offset: done_below(name),
                ..levee_store::Retention::default()
            }
        } else if names::is_reserved(name) {
            levee_store::Retention::default()
        } else {
            rule(name)
        }
    })?;
    Ok(report.messages_removed)
}
