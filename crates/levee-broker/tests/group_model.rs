//! Property tests of the group coordinator against a simple model, with virtual time: random
//! joins, leaves, renewals, expiries and commits (fresh and stale) from up to six members.
//!
//! Invariants checked after every step:
//! - no partition is ever owned by two members, nor by one that is not live, and while a
//!   member is live every partition has an owner; loads differ by at most one;
//! - a commit under an epoch that is not the partition's current one, or by a member that
//!   does not own it, is refused ([`GroupError::Fenced`]) and changes nothing;
//! - committed offsets only move forward, and equal the model's maximum of accepted commits;
//! - a call raises a partition's epoch by one at most (one step per handoff);
//! - the coordinator is a pure function of its calls: a second one fed the same calls is equal.

use std::collections::HashMap;

use levee_broker::group::{GroupCoordinator, GroupError};
use proptest::prelude::*;

/// One call to the coordinator.
#[derive(Debug, Clone)]
enum Step {
    Join {
        member: usize,
        lease_ms: u64,
    },
    Leave {
        member: usize,
    },
    Renew {
        member: usize,
    },
    Expire,
    /// A commit by `member` of its `pick`-th owned partition under the current epoch.
    Commit {
        member: usize,
        pick: usize,
        next_offset: u64,
    },
    /// A commit of `partition` under an epoch one or more behind the current one.
    StaleCommit {
        member: usize,
        partition: u32,
        behind: u64,
        next_offset: u64,
    },
    /// Time passes.
    Advance {
        ms: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0_usize..6, 100_u64..2_000).prop_map(|(member, lease_ms)| Step::Join { member, lease_ms }),
        1 => (0_usize..6).prop_map(|member| Step::Leave { member }),
        2 => (0_usize..6).prop_map(|member| Step::Renew { member }),
        1 => Just(Step::Expire),
        4 => (0_usize..6, 0_usize..8, 0_u64..1_000)
            .prop_map(|(member, pick, next_offset)| Step::Commit { member, pick, next_offset }),
        2 => (0_usize..6, 0_u32..12, 1_u64..4, 0_u64..1_000).prop_map(
            |(member, partition, behind, next_offset)| Step::StaleCommit {
                member,
                partition,
                behind,
                next_offset,
            }
        ),
        2 => (1_u64..800).prop_map(|ms| Step::Advance { ms }),
    ]
}

/// The partitions' end: every partition holds 1,000 messages.
const END: u64 = 1_000;

fn name(member: usize) -> String {
    format!("m{member}")
}

/// Applies `step` to `coordinator`; the model keeps sessions and the highest accepted commits.
fn apply(
    coordinator: &mut GroupCoordinator,
    step: &Step,
    now_ms: &mut u64,
    sessions: &mut HashMap<String, u64>,
    next_session: &mut u64,
    model_committed: &mut [u64],
) -> Result<(), TestCaseError> {
    match step {
        Step::Join { member, lease_ms } => {
            *next_session += 1;
            coordinator
                .join(&name(*member), *next_session, *lease_ms, *now_ms)
                .map_err(|error| TestCaseError::fail(error.to_string()))?;
            sessions.insert(name(*member), *next_session);
        }
        Step::Leave { member } => {
            if let Some(session) = sessions.remove(&name(*member)) {
                prop_assert!(coordinator.leave(&name(*member), session));
            }
        }
        Step::Renew { member } => {
            if let Some(session) = sessions.get(&name(*member)) {
                prop_assert!(coordinator.renew(&name(*member), *session, *now_ms));
            }
        }
        Step::Expire => {
            for expired in coordinator.expire(*now_ms) {
                prop_assert!(
                    sessions.remove(&expired).is_some(),
                    "{expired} was not live"
                );
            }
        }
        Step::Commit {
            member,
            pick,
            next_offset,
        } => {
            let assignment = coordinator.assignment(&name(*member));
            if let Some(owned) = assignment.partitions.get(*pick) {
                let accepted = coordinator.commit(
                    &name(*member),
                    owned.partition,
                    owned.epoch,
                    *next_offset,
                    END,
                );
                prop_assert!(accepted.is_ok(), "{accepted:?}");
                let slot = &mut model_committed[owned.partition as usize];
                *slot = (*slot).max(*next_offset);
            }
        }
        Step::StaleCommit {
            member,
            partition,
            behind,
            next_offset,
        } => {
            let current = coordinator
                .owners()
                .nth(*partition as usize)
                .map(|(_, epoch)| epoch);
            if let Some(current) = current {
                let before = coordinator.committed().to_vec();
                let stale = current.saturating_sub(*behind);
                let refused =
                    coordinator.commit(&name(*member), *partition, stale, *next_offset, END);
                if stale != current {
                    prop_assert!(
                        matches!(refused, Err(GroupError::Fenced { .. })),
                        "a commit under epoch {stale} (now {current}) was {refused:?}"
                    );
                    prop_assert_eq!(coordinator.committed(), &before[..]);
                } else if refused.is_ok() {
                    let slot = &mut model_committed[*partition as usize];
                    *slot = (*slot).max(*next_offset);
                }
            }
        }
        Step::Advance { ms } => *now_ms += ms,
    }
    Ok(())
}

fn check_ownership(
    coordinator: &GroupCoordinator,
    sessions: &HashMap<String, u64>,
) -> Result<(), TestCaseError> {
    let mut loads: HashMap<&str, usize> = HashMap::new();
    for (owner, _) in coordinator.owners() {
        match owner {
            Some(owner) => {
                prop_assert!(sessions.contains_key(owner), "{owner} owns but is not live");
                *loads.entry(owner).or_default() += 1;
            }
            None => prop_assert!(sessions.is_empty(), "a free partition while members live"),
        }
    }
    if !sessions.is_empty() {
        let most = loads.values().max().copied().unwrap_or(0);
        let least = sessions
            .keys()
            .map(|member| loads.get(member.as_str()).copied().unwrap_or(0))
            .min()
            .unwrap_or(0);
        prop_assert!(most - least <= 1, "{loads:?}");
    }
    // Each member's assignment lists exactly the partitions it owns: no partition twice.
    let assigned: usize = sessions
        .keys()
        .map(|member| coordinator.assignment(member).partitions.len())
        .sum();
    prop_assert_eq!(assigned, loads.values().sum::<usize>());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn given_any_calls_then_ownership_fencing_and_commits_hold(
        partitions in 1_u32..12,
        steps in proptest::collection::vec(step(), 1..120),
    ) {
        let mut coordinator = GroupCoordinator::new(partitions, vec![]);
        let mut replica = GroupCoordinator::new(partitions, vec![]);
        let (mut now_ms, mut replica_now_ms) = (0, 0);
        let mut sessions = HashMap::new();
        let mut replica_sessions = HashMap::new();
        let (mut next_session, mut replica_next_session) = (0, 0);
        let mut model_committed = vec![0; partitions as usize];
        let mut replica_committed = vec![0; partitions as usize];
        for step in &steps {
            let before = coordinator.committed().to_vec();
            let epochs_before: Vec<u64> = coordinator.owners().map(|(_, epoch)| epoch).collect();
            apply(&mut coordinator, step, &mut now_ms, &mut sessions, &mut next_session,
                &mut model_committed)?;
            apply(&mut replica, step, &mut replica_now_ms, &mut replica_sessions,
                &mut replica_next_session, &mut replica_committed)?;
            check_ownership(&coordinator, &sessions)?;
            for (old, new) in before.iter().zip(coordinator.committed()) {
                prop_assert!(new >= old, "a committed offset went back: {old} -> {new}");
            }
            prop_assert_eq!(coordinator.committed(), &model_committed[..]);
            for (old, (_, new)) in epochs_before.iter().zip(coordinator.owners()) {
                prop_assert!(new == *old || new == old + 1, "an epoch went {old} -> {new}");
            }
            prop_assert_eq!(&coordinator, &replica, "the same calls decided differently");
        }
    }
}
