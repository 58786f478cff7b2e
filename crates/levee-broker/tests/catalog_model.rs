//! Property tests of the metadata catalog against a simple model: random commands (valid and
//! not) are decided and applied, their records logged as the server logs them.
//!
//! Invariants checked:
//! - the catalog equals the model: topics with their counts, rates, retention rules;
//! - replaying the logged records (encoded and decoded) into a fresh catalog rebuilds an equal
//!   catalog, as a restarted server or a replica does;
//! - a refused command logs nothing and changes nothing.

use std::collections::BTreeMap;

use levee_broker::catalog::{Catalog, CatalogCommand, CatalogRecord, RetentionRule};
use proptest::prelude::*;

fn command() -> impl Strategy<Value = CatalogCommand> {
    let topic = prop_oneof![Just("orders"), Just("pay"), Just("bad name"), Just("")];
    let group = prop_oneof![Just("g1"), Just("g2"), Just("")];
    let rate = prop_oneof![
        Just(0.0),
        Just(5.0),
        Just(1e-9),
        Just(f64::NAN),
        Just(350_000.0)
    ];
    let prefix = prop_oneof![
        Just(b"".to_vec()),
        Just(b"driver-".to_vec()),
        Just(b"driver-7".to_vec()),
        Just(b"\0position".to_vec())
    ];
    prop_oneof![
        (topic, 0_u32..5).prop_map(|(topic, partitions)| CatalogCommand::CreateTopic {
            topic: topic.to_owned(),
            partitions,
        }),
        (group.clone(), rate.clone()).prop_map(|(group, messages_per_s)| {
            CatalogCommand::SetGroupRate {
                group: group.to_owned(),
                messages_per_s,
            }
        }),
        (group, rate).prop_map(|(producer_name, messages_per_s)| {
            CatalogCommand::SetProducerRate {
                producer_name: producer_name.to_owned(),
                messages_per_s,
            }
        }),
        (prefix, 0_u64..3, 0_u64..3).prop_map(|(prefix, max_age_ms, max_bytes)| {
            CatalogCommand::SetRetention {
                prefix,
                rule: RetentionRule {
                    max_age_ms,
                    max_bytes,
                },
            }
        }),
    ]
}

/// What the catalog should hold, kept the simplest way.
#[derive(Debug, Default)]
struct Model {
    topics: BTreeMap<String, u32>,
    group_rates: BTreeMap<String, f64>,
    producer_rates: BTreeMap<String, f64>,
    retention: BTreeMap<Vec<u8>, RetentionRule>,
}

fn rate_valid(rate: f64) -> bool {
    rate == 0.0 || (rate.is_finite() && rate >= 1.0 / 3600.0)
}

impl Model {
    /// Applies a command; whether it is valid.
    fn apply(&mut self, command: &CatalogCommand) -> bool {
        match command {
            CatalogCommand::CreateTopic { topic, partitions } => {
                let valid_name = !topic.is_empty() && !topic.contains(' ');
                if !valid_name || *partitions == 0 {
                    return false;
                }
                *self.topics.entry(topic.clone()).or_insert(*partitions) == *partitions
            }
            CatalogCommand::SetGroupRate {
                group,
                messages_per_s,
            } => {
                if group.is_empty() || !rate_valid(*messages_per_s) {
                    return false;
                }
                self.group_rates.insert(group.clone(), *messages_per_s);
                true
            }
            CatalogCommand::SetProducerRate {
                producer_name,
                messages_per_s,
            } => {
                if producer_name.is_empty() || !rate_valid(*messages_per_s) {
                    return false;
                }
                if *messages_per_s > 0.0 {
                    self.producer_rates
                        .insert(producer_name.clone(), *messages_per_s);
                } else {
                    self.producer_rates.remove(producer_name);
                }
                true
            }
            CatalogCommand::SetRetention { prefix, rule } => {
                if prefix.first() == Some(&0) {
                    return false;
                }
                if *rule == RetentionRule::default() {
                    self.retention.remove(prefix);
                } else {
                    self.retention.insert(prefix.clone(), *rule);
                }
                true
            }
            // Not generated here: the catalog's unit tests cover retry policies.
            CatalogCommand::SetRetryPolicy { .. } => unreachable!("not generated"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn given_any_commands_then_the_catalog_matches_the_model_and_its_log_replays(
        commands in proptest::collection::vec(command(), 1..60),
    ) {
        let mut catalog = Catalog::default();
        let mut model = Model::default();
        let mut log: Vec<Vec<u8>> = Vec::new();
        for command in &commands {
            let before = catalog.clone();
            let valid = model.apply(command);
            match catalog.decide(command) {
                Ok(Some(record)) => {
                    prop_assert!(valid, "{command:?} was accepted");
                    let offset = u64::try_from(log.len()).unwrap();
                    catalog.apply(&record, offset).unwrap();
                    log.push(record.encode());
                }
                Ok(None) => prop_assert!(valid, "{command:?} was taken as a repeat"),
                Err(error) => {
                    prop_assert!(!valid || matches!(command, CatalogCommand::CreateTopic { .. }),
                        "{command:?} was refused: {error}");
                    prop_assert_eq!(&catalog, &before, "a refused command changed the catalog");
                }
            }
        }
        let topics: BTreeMap<String, u32> =
            catalog.topics().map(|topic| (topic.name.clone(), topic.partitions())).collect();
        prop_assert_eq!(&topics, &model.topics);
        for (group, rate) in &model.group_rates {
            prop_assert!(catalog.group_rate(group).to_bits() == rate.to_bits());
        }
        prop_assert_eq!(catalog.producer_rates(), &model.producer_rates);
        prop_assert_eq!(catalog.retention().len(), model.retention.len());
        for queue in [&b"driver-77"[..], b"driver-8", b"rider", b""] {
            let expected = (0..=queue.len())
                .rev()
                .find_map(|length| model.retention.get(&queue[..length]).copied())
                .unwrap_or_default();
            prop_assert_eq!(catalog.retention().rule_for(queue), expected);
        }

        let mut replayed = Catalog::default();
        for (offset, bytes) in (0_u64..).zip(&log) {
            replayed.apply(&CatalogRecord::decode(bytes, offset).unwrap(), offset).unwrap();
        }
        prop_assert_eq!(&replayed, &catalog, "replaying the log rebuilt another catalog");

        let mut restored = Catalog::default();
        for (offset, record) in (0_u64..).zip(catalog.records()) {
            restored.apply(&record, offset).unwrap();
        }
        prop_assert_eq!(&restored, &catalog, "the snapshot's records rebuilt another catalog");
    }
}
