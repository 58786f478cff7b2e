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

/// Records what the state machine tells its observer.
#[derive(Debug, Default)]
struct Told(std::sync::Mutex<Vec<String>>);

impl levee_cluster::HotKeyObserver for Told {
    fn rules(&self, app: &str, rules: &[levee_proto::json::RuleRecord]) {
        self.0
            .lock()
            .unwrap()
            .push(format!("rules {app} {}", rules.len()));
    }
    fn manual_hot(&self, app: &str, key: &[u8], expires_at_ms: u64) {
        let key = String::from_utf8_lossy(key);
        self.0
            .lock()
            .unwrap()
            .push(format!("hot {app} {key} {expires_at_ms}"));
    }
    fn cooled(&self, app: &str, key: &[u8]) {
        let key = String::from_utf8_lossy(key);
        self.0.lock().unwrap().push(format!("cool {app} {key}"));
    }
    fn reset(&self, meta: &levee_cluster::HotKeyMeta) {
        self.0.lock().unwrap().push(format!(
            "reset {} apps {} keys",
            meta.rules.len(),
            meta.manual.len()
        ));
    }
}

fn hot_entry(index: u64, command: MetaCommand) -> Entry<MetaConfig> {
    Entry {
        log_id: log_id(1, 0, index),
        payload: EntryPayload::Normal(command),
    }
}

fn manual(key: &str, expires_at_ms: u64, now_ms: u64) -> MetaCommand {
    MetaCommand::SetManualHotKey {
        app: "shop".to_owned(),
        key: key.as_bytes().to_vec(),
        expires_at_ms,
        now_ms,
    }
}

#[tokio::test]
async fn given_hot_key_commands_then_the_observer_follows_expired_keys_go_and_a_snapshot_keeps_them()
 {
    let directory = tempfile::tempdir().unwrap();
    let told = std::sync::Arc::new(Told::default());
    let mut machine = MetaStateMachine::open(directory.path())
        .unwrap()
        .with_observer(told.clone());
    let rule = levee_proto::json::RuleRecord {
        match_kind: "prefix".to_owned(),
        key: Some("sku-".to_owned()),
        key_hex: None,
        window_ms: 1_000,
        threshold: 5,
        hot_duration_ms: 2_000,
        description: String::new(),
    };
    let rules = MetaCommand::SetHotKeyRules {
        app: "shop".to_owned(),
        rules: vec![rule],
    };
    let responses = machine
        .apply([
            hot_entry(1, rules.clone()),
            hot_entry(2, rules),
            hot_entry(3, manual("a", 1_000, 100)),
            // Written at 2 000: key a expired at 1 000 and is dropped.
            hot_entry(4, manual("b", 5_000, 2_000)),
            hot_entry(
                5,
                MetaCommand::RemoveHotKey {
                    app: "shop".to_owned(),
                    key: b"a".to_vec(),
                    now_ms: 2_100,
                },
            ),
        ])
        .await
        .unwrap();
    let changed: Vec<bool> = responses.iter().map(|response| response.changed).collect();
    assert_eq!(changed, [true, false, true, true, false]);
    assert_eq!(
        *told.0.lock().unwrap(),
        [
            "reset 0 apps 0 keys",
            "rules shop 1",
            "rules shop 1",
            "hot shop a 1000",
            "hot shop b 5000",
            "cool shop a",
        ]
    );
    machine
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();
    drop(machine);

    // A new process starts from the snapshot: the observer gets the whole state at once.
    let told = std::sync::Arc::new(Told::default());
    let reopened = MetaStateMachine::open(directory.path())
        .unwrap()
        .with_observer(told.clone());
    assert_eq!(*told.0.lock().unwrap(), ["reset 1 apps 1 keys"]);
    reopened.with_hot_keys(|meta| {
        assert_eq!(
            meta.manual.keys().cloned().collect::<Vec<_>>(),
            [("shop".to_owned(), b"b".to_vec())]
        );
    });
}
