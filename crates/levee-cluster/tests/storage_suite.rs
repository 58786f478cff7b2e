//! openraft's own storage test suite against the log store and the state machine on disk:
//! the properties openraft relies on (log state, votes, appends, truncation, purge, applying
//! entries, membership, snapshots).

#![allow(
    clippy::result_large_err,
    reason = "openraft's StorageError is what its storage traits return"
)]

use levee_cluster::{LogStore, MetaConfig, MetaStateMachine, StorageError};
use openraft::testing::{StoreBuilder, Suite};

/// A fresh log and state machine in a temporary directory (removed when the guard drops).
struct OnDisk;

impl StoreBuilder<MetaConfig, LogStore, MetaStateMachine, tempfile::TempDir> for OnDisk {
    async fn build(&self) -> Result<(tempfile::TempDir, LogStore, MetaStateMachine), StorageError> {
        let directory = tempfile::tempdir().expect("a temporary directory");
        let log = LogStore::open(&directory.path().join("log"))?;
        let machine = MetaStateMachine::open(&directory.path().join("state"))?;
        Ok((directory, log, machine))
    }
}

#[test]
fn given_openraft_storage_suite_then_the_log_and_the_state_machine_pass_it()
-> Result<(), StorageError> {
    Suite::test_all(OnDisk)
}
