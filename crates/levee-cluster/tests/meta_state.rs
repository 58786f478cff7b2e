//! The metadata state machine and log on disk: catalog commands applied from entries answer as
//! the broker engine decides, a snapshot restores the same catalog in a new process, and the
//! log and vote survive a reopen.

use levee_broker::catalog::{CatalogCommand, CatalogError};
use levee_cluster::{LogStore, MetaCommand, MetaConfig, MetaStateMachine};
use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::log_id;
use openraft::{Entry, EntryPayload, RaftLogReader, RaftSnapshotBuilder, Vote};

fn entry(index: u64, command: CatalogCommand) -> Entry<MetaConfig> {
    Entry {
        log_id: log_id(1, 0, index),
        payload: EntryPayload::Normal(MetaCommand::Catalog(command)),
    }
}

fn create(topic: &str, partitions: u32) -> CatalogCommand {
    CatalogCommand::CreateTopic {
        topic: topic.to_owned(),
        partitions,
    }
}

#[tokio::test]
async fn given_catalog_entries_then_answers_follow_the_engine_and_a_snapshot_restores_them() {
    let directory = tempfile::tempdir().unwrap();
    let mut machine = MetaStateMachine::open(directory.path()).unwrap();
    let responses = machine
        .apply([
            entry(1, create("orders", 8)),
            entry(2, create("orders", 8)),
            entry(3, create("orders", 4)),
            entry(
                4,
                CatalogCommand::SetGroupRate {
                    group: "billing".to_owned(),
                    messages_per_s: 5.0,
                },
            ),
        ])
        .await
        .unwrap();
    let changed: Vec<bool> = responses.iter().map(|response| response.changed).collect();
    assert_eq!(changed, [true, false, false, true]);
    assert!(matches!(
        responses[2].refused,
        Some(CatalogError::PartitionsChanged { partitions: 8, .. })
    ));
    let snapshot = machine
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();
    assert_eq!(snapshot.meta.last_log_id, Some(log_id(1, 0, 4)));
    drop(machine);

    // A new process: the snapshot on disk restores the catalog and the applied position.
    let mut reopened = MetaStateMachine::open(directory.path()).unwrap();
    let (applied, _) = reopened.applied_state().await.unwrap();
    assert_eq!(applied, Some(log_id(1, 0, 4)));
    reopened.with_catalog(|catalog| {
        assert_eq!(catalog.require_topic("orders").unwrap().partitions(), 8);
        assert!((catalog.group_rate("billing") - 5.0).abs() < f64::EPSILON);
    });
}

#[tokio::test]
async fn given_a_vote_and_a_committed_point_then_a_reopened_log_holds_them() {
    let directory = tempfile::tempdir().unwrap();
    {
        let mut log = LogStore::open(directory.path()).unwrap();
        log.save_vote(&Vote::new(3, 1)).await.unwrap();
        log.save_committed(Some(log_id(2, 1, 7))).await.unwrap();
    }
    let mut log = LogStore::open(directory.path()).unwrap();
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(3, 1)));
    assert_eq!(log.read_committed().await.unwrap(), Some(log_id(2, 1, 7)));
    assert!(log.try_get_log_entries(0..10).await.unwrap().is_empty());
}
