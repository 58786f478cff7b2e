//! [`JournalSyncer`]: the group commit of a fjall keyspace shared by many Raft groups (a
//! node's shards). Writers put their batches in the keyspace without waiting, then ask the
//! syncer: one thread fsyncs the journal once for every request that arrived while the last
//! fsync ran, and then tells each one. Sixteen shards appending at once cost one fsync, not
//! sixteen in a row, and a shard's Raft core does not wait on the disk while it replicates.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use fjall::{Keyspace, PersistMode};

/// What a request is told once the fsync that covers it ran: `Ok`, or the error as text.
pub type Synced = Box<dyn FnOnce(Result<(), String>) + Send>;

/// How long the thread sleeps between checks that it is still wanted, when idle.
const IDLE_CHECK: Duration = Duration::from_millis(200);

struct Inner {
    keyspace: Keyspace,
    pending: Mutex<Vec<Synced>>,
    wake: Condvar,
    stopped: AtomicBool,
}

/// The group commit of one keyspace. Clones share its thread, which ends with
/// [`JournalSyncer::stop`] or once every clone is dropped.
#[derive(Clone)]
pub struct JournalSyncer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for JournalSyncer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("JournalSyncer")
    }
}

impl JournalSyncer {
    /// Starts the syncing thread of `keyspace`.
    pub fn start(keyspace: Keyspace) -> std::io::Result<Self> {
        let inner = Arc::new(Inner {
            keyspace,
            pending: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stopped: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("levee-log-sync".to_owned())
            .spawn(move || {
                while let Some(inner) = weak.upgrade() {
                    if !inner.round() {
                        break;
                    }
                }
            })?;
        Ok(Self { inner })
    }

    /// Calls `synced` once everything written to the keyspace before this call is fsynced
    /// (or the fsync failed).
    pub fn after_sync(&self, synced: Synced) {
        if self.inner.stopped.load(Ordering::Acquire) {
            synced(Err("the log is closed".to_owned()));
            return;
        }
        self.inner
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(synced);
        self.inner.wake.notify_one();
    }

    /// Blocks until everything written to the keyspace before this call is fsynced.
    pub fn sync(&self) -> Result<(), String> {
        let (sender, receiver) = std::sync::mpsc::sync_channel(1);
        self.after_sync(Box::new(move |result| {
            let _ = sender.send(result);
        }));
        receiver
            .recv()
            .unwrap_or_else(|_| Err("the log syncer stopped".to_owned()))
    }

    /// Ends the thread once it has served what is pending.
    pub fn stop(&self) {
        self.inner.stopped.store(true, Ordering::Release);
        self.inner.wake.notify_one();
    }
}

impl Inner {
    /// Waits for requests, fsyncs once for all of them and tells them. False once stopped
    /// with nothing left to serve.
    fn round(&self) -> bool {
        let taken = {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            if pending.is_empty() {
                if self.stopped.load(Ordering::Acquire) {
                    return false;
                }
                pending = self
                    .wake
                    .wait_timeout(pending, IDLE_CHECK)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            std::mem::take(&mut *pending)
        };
        if taken.is_empty() {
            return true;
        }
        let result = self
            .keyspace
            .persist(PersistMode::SyncAll)
            .map_err(|error| error.to_string());
        for synced in taken {
            synced(result.clone());
        }
        true
    }
}
