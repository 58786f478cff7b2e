//! [`GroupCoordinator`]: the coordinator of one consumer group on one topic: members, who owns
//! which partition under which epoch, committed offsets.
//!
//! Rebalancing is sticky: with M members and P partitions each member's quota is P / M, and
//! the first P mod M members (those owning most now) get one more. Members keep what they own
//! up to their quota; only the excess and the partitions of departed members move, to members
//! under quota. Every change of owner raises the partition's epoch, and a commit must carry
//! the epoch its messages were delivered under, so a stale owner can never commit.

use std::collections::{BTreeMap, HashMap};

use super::{Assignment, GroupError, MEMBERS_MAX, PartitionAssignment, encode_committed};

/// One commit a member asks for: `partition` (or its retry queue, with `retry`) delivered up
/// to `next_offset` under `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// The partition.
    pub partition: u32,
    /// The epoch its messages were delivered under.
    pub epoch: u64,
    /// The next offset to deliver: every message before it is done.
    pub next_offset: u64,
    /// The commit is of the partition's retry queue, not of the partition.
    pub retry: bool,
}

/// What a commit batch decided: each commit's refusal (if any), in order, and the snapshot
/// record to log (`None` when nothing was accepted), which must be durable before the batch
/// is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitOutcome {
    /// Per commit: `None` if accepted, else why not.
    pub refusals: Vec<Option<GroupError>>,
    /// The group's committed offsets after the batch, as the record to log.
    pub record: Option<Vec<u8>>,
}

/// One member as the coordinator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MemberState {
    /// Tells this stream from an older one with the same member id.
    session: u64,
    lease_ms: u64,
    expires_at_ms: u64,
}

/// The coordinator of one consumer group on one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupCoordinator {
    partitions: u32,
    generation: u64,
    members: BTreeMap<String, MemberState>,
    owners: Vec<Option<String>>,
    epochs: Vec<u64>,
    /// Each partition's committed offset, then each partition's retry queue's.
    committed: Vec<u64>,
}

impl GroupCoordinator {
    /// A group with no members over `partitions` partitions, starting from `committed` (one
    /// offset per partition, then one per partition's retry queue; missing ones start at 0,
    /// extra ones are dropped).
    pub fn new(partitions: u32, mut committed: Vec<u64>) -> Self {
        let count = partitions as usize;
        committed.resize(count * 2, 0);
        Self {
            partitions,
            generation: 0,
            members: BTreeMap::new(),
            owners: vec![None; count],
            epochs: vec![0; count],
            committed,
        }
    }

    /// The generation, raised on every rebalance.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Adds (or replaces) `member` with a new session and rebalances. Refused when the group
    /// holds [`MEMBERS_MAX`] members and this is a new one.
    pub fn join(
        &mut self,
        member: &str,
        session: u64,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<(), GroupError> {
        if self.members.len() >= MEMBERS_MAX && !self.members.contains_key(member) {
            return Err(GroupError::MembersFull);
        }
        self.members.insert(
            member.to_owned(),
            MemberState {
                session,
                lease_ms,
                expires_at_ms: now_ms.saturating_add(lease_ms),
            },
        );
        // A replaced stream's partitions move to the new one: new epochs fence the old.
        self.rebalance(Some(member));
        Ok(())
    }

    /// Removes `member` if `session` is still its current one; true if it was removed.
    pub fn leave(&mut self, member: &str, session: u64) -> bool {
        if !self.is_member(member, session) {
            return false;
        }
        self.members.remove(member);
        self.rebalance(None);
        true
    }

    /// Renews `member`'s lease; false if the session is no longer a member.
    pub fn renew(&mut self, member: &str, session: u64, now_ms: u64) -> bool {
        match self.members.get_mut(member) {
            Some(state) if state.session == session => {
                state.expires_at_ms = now_ms.saturating_add(state.lease_ms);
                true
            }
            _ => false,
        }
    }

    /// Removes every member whose lease ran out by `now_ms`; returns their ids.
    pub fn expire(&mut self, now_ms: u64) -> Vec<String> {
        let expired: Vec<String> = self
            .members
            .iter()
            .filter(|(_, state)| state.expires_at_ms <= now_ms)
            .map(|(member, _)| member.clone())
            .collect();
        if !expired.is_empty() {
            for member in &expired {
                self.members.remove(member);
            }
            self.rebalance(None);
        }
        expired
    }

    /// Whether `session` is `member`'s current session.
    pub fn is_member(&self, member: &str, session: u64) -> bool {
        self.members
            .get(member)
            .is_some_and(|state| state.session == session)
    }

    /// How many members the group has.
    pub fn member_count(&self) -> usize {
        self.members.len()
    }

    /// Moves partitions to the live members (see the module docs), then raises by one the
    /// epoch of every partition whose owner changed, and of those `replaced` owned (its stream
    /// was replaced): one step per handoff, so a stale owner's epoch is always behind.
    fn rebalance(&mut self, replaced: Option<&str>) {
        self.generation += 1;
        let before = self.owners.clone();
        let members = &self.members;
        for owner in &mut self.owners {
            if owner
                .as_ref()
                .is_some_and(|owner| !members.contains_key(owner))
            {
                *owner = None;
            }
        }
        if !self.members.is_empty() {
            let quota = self.quotas();
            let kept = self.release_excess(&quota);
            // Hand free partitions to members under quota, in member order.
            let mut takers = self
                .members
                .keys()
                .flat_map(|member| {
                    let missing = quota[member] - kept.get(member).copied().unwrap_or(0);
                    std::iter::repeat_n(member.clone(), missing)
                })
                .collect::<Vec<_>>()
                .into_iter();
            for owner in &mut self.owners {
                if owner.is_none()
                    && let Some(member) = takers.next()
                {
                    *owner = Some(member);
                }
            }
        }
        for ((owner, old), epoch) in self.owners.iter().zip(&before).zip(&mut self.epochs) {
            if owner != old || (replaced.is_some() && old.as_deref() == replaced) {
                *epoch += 1;
            }
        }
    }

    /// Each member's quota: P / M, one more for the first P mod M of those owning most now
    /// (so fewer partitions move).
    fn quotas(&self) -> HashMap<String, usize> {
        let member_count = self.members.len();
        let partitions = self.partitions as usize;
        let (base, extra) = (partitions / member_count, partitions % member_count);
        let mut owned: HashMap<&str, usize> = HashMap::new();
        for owner in self.owners.iter().flatten() {
            *owned.entry(owner.as_str()).or_default() += 1;
        }
        // A stable sort over the members' name order: ties keep that order.
        let mut order: Vec<&String> = self.members.keys().collect();
        order.sort_by_key(|member| std::cmp::Reverse(owned.get(member.as_str()).copied()));
        order
            .iter()
            .enumerate()
            .map(|(rank, member)| ((*member).clone(), base + usize::from(rank < extra)))
            .collect()
    }

    /// Releases what owners hold over their quota, highest partitions first; returns how many
    /// each member keeps.
    fn release_excess(&mut self, quota: &HashMap<String, usize>) -> HashMap<String, usize> {
        let mut kept: HashMap<String, usize> = HashMap::new();
        for owner in &mut self.owners {
            if let Some(member) = owner {
                let count = kept.entry(member.clone()).or_default();
                if *count < quota[member.as_str()] {
                    *count += 1;
                } else {
                    *owner = None;
                }
            }
        }
        kept
    }

    /// What `member` owns now, with epochs and start offsets.
    pub fn assignment(&self, member: &str) -> Assignment {
        Assignment {
            generation: self.generation,
            partitions: (0_u32..)
                .zip(&self.owners)
                .filter(|(_, owner)| owner.as_deref() == Some(member))
                .map(|(partition, _)| PartitionAssignment {
                    partition,
                    epoch: self.epochs[partition as usize],
                    start_offset: self.committed[partition as usize],
                    retry_start_offset: self.committed[self.owners.len() + partition as usize],
                })
                .collect(),
        }
    }

    /// Checks that `member` owns `partition` under `epoch`, so it may commit it.
    pub fn check_commit(&self, member: &str, partition: u32, epoch: u64) -> Result<(), GroupError> {
        let Some(owner) = self.owners.get(partition as usize) else {
            return Err(GroupError::NoSuchPartition {
                partition,
                partitions: self.partitions,
            });
        };
        let current = self.epochs[partition as usize];
        if owner.as_deref() != Some(member) || current != epoch {
            return Err(GroupError::Fenced {
                partition,
                member: member.to_owned(),
                epoch,
                current,
            });
        }
        Ok(())
    }

    /// Commits `partition` up to `next_offset` for `member` under `epoch`, where `end` is the
    /// partition's next offset. Refused for a stale owner ([`GroupError::Fenced`]) or past the
    /// end; committed offsets never go back (a lower commit is accepted and changes nothing).
    /// Returns whether the committed offset moved.
    pub fn commit(
        &mut self,
        member: &str,
        partition: u32,
        epoch: u64,
        next_offset: u64,
        end: u64,
    ) -> Result<bool, GroupError> {
        let commit = Commit {
            partition,
            epoch,
            next_offset,
            retry: false,
        };
        self.commit_lane(member, &commit, end)
    }

    /// [`GroupCoordinator::commit`] of the partition or of its retry queue.
    fn commit_lane(&mut self, member: &str, commit: &Commit, end: u64) -> Result<bool, GroupError> {
        self.check_commit(member, commit.partition, commit.epoch)?;
        if commit.next_offset > end {
            return Err(GroupError::PastEnd {
                partition: commit.partition,
                next_offset: commit.next_offset,
                end,
                retry: commit.retry,
            });
        }
        let lane = if commit.retry { self.owners.len() } else { 0 };
        let slot = &mut self.committed[lane + commit.partition as usize];
        let moved = commit.next_offset > *slot;
        *slot = (*slot).max(commit.next_offset);
        Ok(moved)
    }

    /// Commits a batch for `member`, each checked as [`GroupCoordinator::commit`] does;
    /// `end_of(partition, retry)` gives the partition's (or its retry queue's) next offset,
    /// asked only for commits that pass
    /// the epoch check (it may read a store: its error ends the batch, with what was
    /// accepted before it kept in memory and logged by the next batch).
    pub fn commit_batch<E>(
        &mut self,
        member: &str,
        commits: &[Commit],
        mut end_of: impl FnMut(u32, bool) -> Result<u64, E>,
    ) -> Result<CommitOutcome, E> {
        let mut refusals = Vec::with_capacity(commits.len());
        let mut accepted = false;
        for commit in commits {
            let decided =
                if let Err(refusal) = self.check_commit(member, commit.partition, commit.epoch) {
                    Err(refusal)
                } else {
                    let end = end_of(commit.partition, commit.retry)?;
                    self.commit_lane(member, commit, end)
                };
            // A commit at or below the committed offset is accepted and logged like any.
            accepted |= decided.is_ok();
            refusals.push(decided.err());
        }
        Ok(CommitOutcome {
            refusals,
            record: accepted.then(|| encode_committed(&self.committed)),
        })
    }

    /// Every partition's committed offset.
    pub fn committed(&self) -> &[u64] {
        &self.committed[..self.owners.len()]
    }

    /// Every partition's retry queue's committed offset.
    pub fn retry_committed(&self) -> &[u64] {
        &self.committed[self.owners.len()..]
    }

    /// Sets the committed offsets of the partitions in `offsets` (they may go back: a reset to
    /// replay). Refused while the group has members unless `force`, which removes them all
    /// (their streams are told to join again; every partition they owned gets a new epoch,
    /// so their commits are fenced). Returns the snapshot record to log.
    pub fn reset(&mut self, offsets: &[(u32, u64)], force: bool) -> Result<Vec<u8>, GroupError> {
        if let Some(&(partition, _)) = offsets
            .iter()
            .find(|(partition, _)| *partition as usize >= self.owners.len())
        {
            return Err(GroupError::NoSuchPartition {
                partition,
                partitions: self.partitions,
            });
        }
        if !self.members.is_empty() {
            if !force {
                return Err(GroupError::MembersActive {
                    members: self.members.len(),
                });
            }
            self.members.clear();
            self.rebalance(None);
        }
        for &(partition, offset) in offsets {
            self.committed[partition as usize] = offset;
        }
        Ok(encode_committed(&self.committed))
    }

    /// Owner and epoch of each partition.
    pub fn owners(&self) -> impl Iterator<Item = (Option<&str>, u64)> {
        self.owners
            .iter()
            .map(Option::as_deref)
            .zip(self.epochs.iter().copied())
    }

    /// Members with their lease expiry times.
    pub fn members(&self) -> impl Iterator<Item = (&str, u64)> {
        self.members
            .iter()
            .map(|(member, state)| (member.as_str(), state.expires_at_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(state: &GroupCoordinator) -> Vec<Option<String>> {
        state
            .owners()
            .map(|(owner, _)| owner.map(str::to_owned))
            .collect()
    }

    fn count(state: &GroupCoordinator, member: &str) -> usize {
        state.assignment(member).partitions.len()
    }

    fn moved(before: &[Option<String>], state: &GroupCoordinator) -> usize {
        before
            .iter()
            .zip(owners(state))
            .filter(|(old, new)| *old != new)
            .count()
    }

    #[test]
    fn given_joins_then_partitions_split_evenly_and_only_the_needed_ones_move() {
        let mut state = GroupCoordinator::new(8, vec![]);
        state.join("a", 1, 10_000, 0).unwrap();
        assert_eq!(count(&state, "a"), 8);
        let before = owners(&state);
        state.join("b", 2, 10_000, 0).unwrap();
        assert_eq!((count(&state, "a"), count(&state, "b")), (4, 4));
        assert_eq!(moved(&before, &state), 4, "only b's share moves");
        let before = owners(&state);
        state.join("c", 3, 10_000, 0).unwrap();
        let sizes = [count(&state, "a"), count(&state, "b"), count(&state, "c")];
        assert_eq!(sizes.iter().sum::<usize>(), 8);
        assert!(sizes.iter().all(|size| (2..=3).contains(size)), "{sizes:?}");
        assert_eq!(
            moved(&before, &state),
            2,
            "c takes 2: one from a, one from b"
        );
    }

    #[test]
    fn given_leave_and_expiry_then_the_rest_take_over_with_new_epochs() {
        let mut state = GroupCoordinator::new(4, vec![7, 0, 0, 3]);
        state.join("a", 1, 1_000, 0).unwrap();
        state.join("b", 2, 5_000, 0).unwrap();
        let a_partitions = state.assignment("a").partitions;
        assert!(
            !state.leave("a", 99),
            "a stale session cannot leave for the member"
        );
        assert!(state.renew("b", 2, 900));
        assert_eq!(state.expire(999), Vec::<String>::new());
        assert_eq!(state.expire(1_000), vec!["a".to_owned()]);
        let b = state.assignment("b");
        assert_eq!(b.partitions.len(), 4);
        for old in &a_partitions {
            let new = b
                .partitions
                .iter()
                .find(|assigned| assigned.partition == old.partition)
                .unwrap();
            assert!(new.epoch > old.epoch);
            assert_eq!(new.start_offset, [7, 0, 0, 3][old.partition as usize]);
            assert!(matches!(
                state.check_commit("a", old.partition, old.epoch),
                Err(GroupError::Fenced { .. })
            ));
        }
        assert!(state.leave("b", 2));
        assert!(owners(&state).iter().all(Option::is_none));
    }

    #[test]
    fn given_handoffs_then_each_raises_the_epoch_by_exactly_one() {
        let mut state = GroupCoordinator::new(2, vec![]);
        let epochs = |state: &GroupCoordinator| -> Vec<u64> {
            state.owners().map(|(_, epoch)| epoch).collect()
        };
        state.join("a", 1, 1_000, 0).unwrap();
        assert_eq!(epochs(&state), [1, 1], "unowned to a");
        state.join("b", 2, 1_000, 0).unwrap();
        assert_eq!(
            epochs(&state),
            [1, 2],
            "partition 1 moved from a to b: one step"
        );
        assert!(state.leave("b", 2));
        assert_eq!(epochs(&state), [1, 3], "back to a: one step");
        state.join("a", 3, 1_000, 0).unwrap();
        assert_eq!(epochs(&state), [2, 4], "a's stream replaced: one step each");
        assert!(state.leave("a", 3));
        assert_eq!(
            epochs(&state),
            [3, 5],
            "released with no one to take them: one step"
        );
    }

    #[test]
    fn given_rejoin_of_same_member_then_old_epochs_are_fenced() {
        let mut state = GroupCoordinator::new(2, vec![]);
        state.join("a", 1, 1_000, 0).unwrap();
        let old = state.assignment("a").partitions[0];
        state.join("a", 2, 1_000, 0).unwrap();
        let new = state.assignment("a").partitions[0];
        assert!(new.epoch > old.epoch);
        assert!(state.check_commit("a", 0, old.epoch).is_err());
        assert!(state.check_commit("a", 0, new.epoch).is_ok());
        assert!(
            !state.leave("a", 1),
            "the replaced session does not remove the new one"
        );
        assert!(state.is_member("a", 2));
    }

    #[test]
    fn given_commits_then_offsets_never_go_back_nor_past_the_end() {
        let mut state = GroupCoordinator::new(1, vec![]);
        state.join("a", 1, 1_000, 0).unwrap();
        let epoch = state.assignment("a").partitions[0].epoch;
        assert_eq!(state.commit("a", 0, epoch, 10, 20), Ok(true));
        assert_eq!(state.commit("a", 0, epoch, 4, 20), Ok(false));
        assert_eq!(state.committed(), &[10]);
        assert_eq!(
            state.commit("a", 0, epoch, 21, 20),
            Err(GroupError::PastEnd {
                partition: 0,
                next_offset: 21,
                end: 20,
                retry: false,
            })
        );
        assert!(matches!(
            state.commit("a", 5, epoch, 1, 20),
            Err(GroupError::NoSuchPartition { partition: 5, .. })
        ));
        assert_eq!(state.committed(), &[10]);
    }

    #[test]
    fn given_a_commit_batch_then_each_commit_is_judged_and_one_snapshot_is_logged() {
        let mut state = GroupCoordinator::new(2, vec![]);
        state.join("a", 1, 1_000, 0).unwrap();
        let epochs: Vec<u64> = state.owners().map(|(_, epoch)| epoch).collect();
        let commits = [
            Commit {
                partition: 0,
                epoch: epochs[0],
                next_offset: 5,
                retry: false,
            },
            Commit {
                partition: 1,
                epoch: epochs[1] + 1,
                next_offset: 5,
                retry: false,
            },
            Commit {
                partition: 1,
                epoch: epochs[1],
                next_offset: 50,
                retry: false,
            },
            Commit {
                partition: 1,
                epoch: epochs[1],
                next_offset: 3,
                retry: true,
            },
        ];
        let mut asked = Vec::new();
        let outcome = state
            .commit_batch("a", &commits, |partition, retry| {
                asked.push((partition, retry));
                Ok::<_, ()>(10)
            })
            .unwrap();
        assert_eq!(
            asked,
            [(0, false), (1, false), (1, true)],
            "the end is read only for commits past the epoch check"
        );
        assert_eq!(outcome.refusals[0], None);
        assert!(matches!(
            outcome.refusals[1],
            Some(GroupError::Fenced { .. })
        ));
        assert!(matches!(
            outcome.refusals[2],
            Some(GroupError::PastEnd { .. })
        ));
        assert_eq!(outcome.refusals[3], None);
        assert_eq!(outcome.record, Some(encode_committed(&[5, 0, 0, 3])));
        assert_eq!(state.retry_committed(), &[0, 3]);
        let refused_only = state
            .commit_batch("b", &commits[..1], |_, _| Ok::<_, ()>(10))
            .unwrap();
        assert_eq!(
            refused_only.record, None,
            "nothing accepted, nothing to log"
        );
        assert_eq!(
            state.commit_batch("a", &commits[..1], |_, _| Err("disk")),
            Err("disk")
        );
    }

    #[test]
    fn given_members_then_a_reset_is_refused_unless_forced_and_forced_fences_them() {
        let mut state = GroupCoordinator::new(2, vec![10, 20, 1, 2]);
        assert_eq!(state.retry_committed(), &[1, 2], "retry offsets load");
        state.join("a", 1, 1_000, 0).unwrap();
        let before: Vec<u64> = state.owners().map(|(_, epoch)| epoch).collect();
        assert_eq!(
            state.reset(&[(0, 3)], false),
            Err(GroupError::MembersActive { members: 1 })
        );
        assert_eq!(state.committed(), &[10, 20], "refused: nothing changed");
        assert!(matches!(
            state.reset(&[(2, 0)], true),
            Err(GroupError::NoSuchPartition { partition: 2, .. })
        ));
        let record = state.reset(&[(0, 3)], true).unwrap();
        assert_eq!(record, encode_committed(&[3, 20, 1, 2]), "offsets go back");
        assert_eq!(state.member_count(), 0);
        for ((owner, epoch), old) in state.owners().zip(before) {
            assert_eq!((owner, epoch), (None, old + 1), "the old owner is fenced");
        }
        assert!(state.check_commit("a", 0, 1).is_err());
    }

    #[test]
    fn given_a_full_group_then_only_a_known_member_may_join() {
        let mut state = GroupCoordinator::new(1, vec![]);
        for member in 0..MEMBERS_MAX {
            state.join(&format!("m{member}"), 0, 1_000, 0).unwrap();
        }
        assert_eq!(
            state.join("one-more", 1, 1_000, 0),
            Err(GroupError::MembersFull)
        );
        assert_eq!(state.join("m0", 2, 1_000, 0), Ok(()));
        assert_eq!(state.member_count(), MEMBERS_MAX);
    }
}
