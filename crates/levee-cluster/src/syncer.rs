//! [`JournalSyncer`]: the group commit of a fjall keyspace shared by many Raft groups (a
//! node's shards). Writers put their batches in the keyspace without waiting, then ask the
//! syncer: one thread fsyncs the journal once for every request that arrived while the last
//! fsync ran, and then tells each one. Sixteen shards appending at once cost one fsync, not
//! sixteen in a row, and a shard's Raft core does not wait on the disk while it replicates.
//!
//! The fsync runs outside fjall's journal lock. fjall's own `persist(SyncAll)` holds the
//! journal's writer lock through the fsync, so every write to the keyspace (each shard's log
//! appends, apply records, votes) would wait for the fsync under way; instead a round hands
//! the journal's buffered bytes to the OS under the lock (`persist(Buffer)`, a write) and
//! then fsyncs the active journal file through a handle of its own, the lock free: writes go
//! on meanwhile, into the next round. fsync covers the file's bytes whatever handle wrote
//! them. The active journal is the one with the largest number in the keyspace's `journals`
//! folder (fjall 2's layout); one sealed meanwhile was fsynced by fjall when it was sealed.
//!
//! Some writes need not be durable at once, only before something else reaches the disk: a
//! shard's apply record, before the queue store writes the messages it names. Their writers
//! note them ([`JournalSyncer::note_write`]) instead of asking for a round, and the store runs
//! [`JournalSyncer::write_barrier`] before each of its writes: it returns at once when a round
//! since (asked for by the log appends, which run all the time under load) covered every
//! noted write, and fsyncs itself otherwise.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use fjall::{Keyspace, PersistMode};

/// What a request is told once the fsync that covers it ran: `Ok`, or the error as text.
pub type Synced = Box<dyn FnOnce(Result<(), String>) + Send>;

/// How long the thread sleeps between checks that it is still wanted, when idle.
const IDLE_CHECK: Duration = Duration::from_millis(200);

struct Inner {
    keyspace: Keyspace,
    /// The keyspace's `journals` folder.
    journals: PathBuf,
    /// The active journal's number and a handle on it, opened on the first round.
    journal: Mutex<Option<(u64, File)>>,
    pending: Mutex<Vec<Synced>>,
    wake: Condvar,
    stopped: AtomicBool,
    /// Writes noted so far ([`JournalSyncer::note_write`]).
    noted: AtomicU64,
    /// The noted writes an fsync covered: every one counted in `noted` before it started.
    noted_synced: AtomicU64,
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
    /// Starts the syncing thread of `keyspace`, opened in `directory`.
    pub fn start(keyspace: Keyspace, directory: &Path) -> std::io::Result<Self> {
        let inner = Arc::new(Inner {
            keyspace,
            journals: directory.join("journals"),
            journal: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stopped: AtomicBool::new(false),
            noted: AtomicU64::new(0),
            noted_synced: AtomicU64::new(0),
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

    /// Ends once everything written to the keyspace before this call is fsynced (or the
    /// fsync failed), holding no thread while it waits.
    pub fn synced(&self) -> impl Future<Output = Result<(), String>> + Send + 'static {
        let (answer, done) = tokio::sync::oneshot::channel();
        self.after_sync(Box::new(move |result| {
            let _ = answer.send(result);
        }));
        async move {
            done.await
                .unwrap_or_else(|_| Err("the log syncer stopped".to_owned()))
        }
    }

    /// Notes a write to the keyspace (made before this call) that must be durable before the
    /// next write the [`JournalSyncer::write_barrier`] guards, without asking for a round.
    pub fn note_write(&self) {
        self.inner.noted.fetch_add(1, Ordering::SeqCst);
    }

    /// A queue store's write barrier (`levee_store::Store::set_write_barrier`) that makes every
    /// noted write durable: at once when an fsync since covered them all, else by fsyncing on
    /// the calling thread (also once the syncer is stopped). It holds the syncer weakly: once
    /// every clone is dropped (its shards closed) it does nothing.
    pub fn write_barrier(&self) -> levee_store::WriteBarrier {
        let inner = Arc::downgrade(&self.inner);
        Arc::new(move || {
            inner.upgrade().map_or(Ok(()), |inner| {
                inner.sync_noted().map_err(std::io::Error::other)
            })
        })
    }

    /// The noted writes an fsync covered, and those noted.
    #[cfg(test)]
    pub(crate) fn noted_counts(&self) -> (u64, u64) {
        (
            self.inner.noted_synced.load(Ordering::SeqCst),
            self.inner.noted.load(Ordering::SeqCst),
        )
    }

    /// Ends the thread once it has served what is pending.
    pub fn stop(&self) {
        self.inner.stopped.store(true, Ordering::Release);
        self.inner.wake.notify_one();
    }
}

impl Inner {
    /// See [`JournalSyncer::write_barrier`].
    fn sync_noted(&self) -> Result<(), String> {
        let noted = self.noted.load(Ordering::SeqCst);
        if self.noted_synced.load(Ordering::SeqCst) >= noted {
            return Ok(());
        }
        self.sync_journal()?;
        self.noted_synced.fetch_max(noted, Ordering::SeqCst);
        Ok(())
    }

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
        let noted = self.noted.load(Ordering::SeqCst);
        let result = self.sync_journal();
        if result.is_ok() {
            self.noted_synced.fetch_max(noted, Ordering::SeqCst);
        }
        for synced in taken {
            synced(result.clone());
        }
        true
    }

    /// Makes everything written to the keyspace so far durable, holding fjall's journal lock
    /// only to hand its buffered bytes to the OS (see the module's text).
    fn sync_journal(&self) -> Result<(), String> {
        self.keyspace
            .persist(PersistMode::Buffer)
            .map_err(|error| error.to_string())?;
        let newest = std::fs::read_dir(&self.journals)
            .map_err(|error| format!("listing {}: {error}", self.journals.display()))?
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .ok_or_else(|| format!("no journal in {}", self.journals.display()))?;
        let mut journal = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        if journal.as_ref().is_none_or(|(number, _)| *number != newest) {
            let path = self.journals.join(newest.to_string());
            let file = File::open(&path)
                .map_err(|error| format!("opening {}: {error}", path.display()))?;
            *journal = Some((newest, file));
        }
        let Some((number, file)) = journal.as_ref() else {
            unreachable!("opened just above");
        };
        file.sync_all()
            .map_err(|error| format!("fsyncing journal {number}: {error}"))
    }
}

#[cfg(test)]
mod tests {
    use fjall::{Config, PartitionCreateOptions};

    use super::*;

    /// A keyspace in a new directory, its partition `name` and its syncer.
    fn keyspace_with_syncer(
        name: &str,
    ) -> (tempfile::TempDir, fjall::PartitionHandle, JournalSyncer) {
        let directory = tempfile::tempdir().expect("a directory");
        let keyspace = Config::new(directory.path()).open().expect("a keyspace");
        let partition = keyspace
            .open_partition(name, PartitionCreateOptions::default())
            .expect("a partition");
        let syncer = JournalSyncer::start(keyspace, directory.path()).expect("a syncer");
        (directory, partition, syncer)
    }

    /// The number of the journal the syncer last fsynced.
    fn fsynced_journal(syncer: &JournalSyncer) -> Option<u64> {
        syncer
            .inner
            .journal
            .lock()
            .unwrap()
            .as_ref()
            .map(|(number, _)| *number)
    }

    #[test]
    fn given_journals_sealed_between_rounds_then_each_round_fsyncs_the_active_one() {
        let (directory, partition, syncer) = keyspace_with_syncer("entries");
        partition.insert("a", "1").expect("a write");
        syncer.sync().expect("a round");
        let first = fsynced_journal(&syncer).expect("a journal fsynced");
        for round in 0..3 {
            // Sealing the memtable seals the journal (fsynced then) and starts the next one;
            // waited for, so that no flush still runs when the keyspace is dropped.
            partition.rotate_memtable_and_wait().expect("a rotation");
            partition.insert(format!("b{round}"), "2").expect("a write");
            syncer.sync().expect("a round");
        }
        let last = fsynced_journal(&syncer).expect("a journal fsynced");
        assert!(
            last > first,
            "the active journal after the rotations: {first} then {last}"
        );
        let newest = std::fs::read_dir(directory.path().join("journals"))
            .unwrap()
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .max();
        assert_eq!(Some(last), newest);
        syncer.stop();
    }

    #[test]
    fn given_noted_writes_then_a_round_or_the_barrier_covers_them_even_once_stopped() {
        let (_directory, partition, syncer) = keyspace_with_syncer("meta");
        let barrier = syncer.write_barrier();
        barrier().expect("nothing noted: nothing to do");
        assert_eq!(fsynced_journal(&syncer), None, "no fsync for nothing noted");

        partition.insert("applying", "1").expect("a write");
        syncer.note_write();
        assert_eq!(
            syncer.noted_counts(),
            (0, 1),
            "a noted write asks for no round"
        );
        barrier().expect("the barrier fsyncs");
        assert_eq!(syncer.noted_counts(), (1, 1));
        assert!(fsynced_journal(&syncer).is_some());

        partition.insert("applying", "2").expect("a write");
        syncer.note_write();
        syncer.sync().expect("a round asked for by another write");
        assert_eq!(
            syncer.noted_counts(),
            (2, 2),
            "a round covers what was noted before it"
        );

        syncer.stop();
        partition.insert("applying", "3").expect("a write");
        syncer.note_write();
        barrier().expect("fsynced on the caller's thread once stopped");
        assert_eq!(syncer.noted_counts(), (3, 3));

        drop(syncer);
        partition.insert("applying", "4").expect("a write");
        barrier().expect("a barrier whose syncer is gone does nothing");
    }
}
