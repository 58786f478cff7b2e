//! Consumer groups. [`GroupState`] is the coordinator of one (group, topic): members, who owns
//! which partition under which epoch, committed offsets. It takes the current time as an
//! argument and does no I/O, so rebalancing, leases and fencing are tested directly.
//! [`Groups`] keeps every group, loads committed offsets from the store, writes commits through
//! the store's log, and tells each member's stream its assignment through a watch channel.
//!
//! Rebalancing is sticky: with M members and P partitions each member's quota is P / M, and
//! the first P mod M members (those owning most now) get one more. Members keep what they own
//! up to their quota; only the excess and the partitions of departed members move, to members
//! under quota. Every change of owner raises the partition's epoch, and a commit must carry
//! the epoch its messages were delivered under, so a stale owner can never commit.
//!
//! Committed offsets are kept as a snapshot of every partition's offset (P x 8 bytes), one
//! record per commit batch in the queue `\0commit\0{group}\0{topic}`; only the last record
//! matters, so the queue is trimmed like consumer positions.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use levee_proto::WireError;
use levee_proto::v1::{Assignment, ErrorCode, PartitionAssignment};
use levee_store::{CommitTicket, Store};
use tokio::sync::watch;

use super::topic::Topic;
use super::{lock, storage_error, write_error};

/// Most members of one group.
pub const MEMBERS_MAX: usize = 1_024;
/// Most groups on one server.
pub const GROUPS_MAX: usize = 10_000;
/// Prefix of every group's commit queue.
pub const COMMIT_PREFIX: &[u8] = b"\0commit\0";

/// One member as the coordinator sees it.
#[derive(Debug, Clone)]
struct MemberState {
    /// Tells this stream from an older one with the same member id.
    session: u64,
    lease_ms: u64,
    expires_at_ms: u64,
}

/// The coordinator of one consumer group on one topic.
#[derive(Debug)]
pub struct GroupState {
    partitions: u32,
    /// Raised on every rebalance.
    pub generation: u64,
    members: BTreeMap<String, MemberState>,
    owners: Vec<Option<String>>,
    epochs: Vec<u64>,
    committed: Vec<u64>,
}

/// Why a commit was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitRefusal {
    /// The member does not own the partition under that epoch.
    Fenced(String),
    /// Partition number out of range.
    Invalid(String),
}

impl GroupState {
    /// A group with no members over `partitions` partitions, starting from `committed` (one
    /// offset per partition; missing ones start at 0).
    pub fn new(partitions: u32, mut committed: Vec<u64>) -> Self {
        let count = partitions as usize;
        committed.resize(count, 0);
        Self {
            partitions,
            generation: 0,
            members: BTreeMap::new(),
            owners: vec![None; count],
            epochs: vec![0; count],
            committed,
        }
    }

    /// Adds (or replaces) `member` with a new session and rebalances.
    pub fn join(&mut self, member: &str, session: u64, lease_ms: u64, now_ms: u64) {
        self.members.insert(
            member.to_owned(),
            MemberState {
                session,
                lease_ms,
                expires_at_ms: now_ms + lease_ms,
            },
        );
        // A replaced stream's partitions move to the new one: new epochs fence the old.
        for (owner, epoch) in self.owners.iter_mut().zip(&mut self.epochs) {
            if owner.as_deref() == Some(member) {
                *epoch += 1;
            }
        }
        self.rebalance();
    }

    /// Removes `member` if `session` is still its current one; true if it was removed.
    pub fn leave(&mut self, member: &str, session: u64) -> bool {
        if self
            .members
            .get(member)
            .is_none_or(|state| state.session != session)
        {
            return false;
        }
        self.members.remove(member);
        self.rebalance();
        true
    }

    /// Renews `member`'s lease; false if the session is no longer a member.
    pub fn renew(&mut self, member: &str, session: u64, now_ms: u64) -> bool {
        match self.members.get_mut(member) {
            Some(state) if state.session == session => {
                state.expires_at_ms = now_ms + state.lease_ms;
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
            self.rebalance();
        }
        expired
    }

    /// Whether `session` is `member`'s current session.
    pub fn is_member(&self, member: &str, session: u64) -> bool {
        self.members
            .get(member)
            .is_some_and(|state| state.session == session)
    }

    fn rebalance(&mut self) {
        self.generation += 1;
        for (owner, epoch) in self.owners.iter_mut().zip(&mut self.epochs) {
            if owner
                .as_ref()
                .is_some_and(|owner| !self.members.contains_key(owner))
            {
                *owner = None;
                *epoch += 1;
            }
        }
        if self.members.is_empty() {
            return;
        }
        let member_count = self.members.len();
        let partitions = self.partitions as usize;
        let (base, extra) = (partitions / member_count, partitions % member_count);
        let mut owned: HashMap<&str, usize> = HashMap::new();
        for owner in self.owners.iter().flatten() {
            *owned.entry(owner.as_str()).or_default() += 1;
        }
        // Those owning most keep the extra slots, so fewer partitions move.
        let mut order: Vec<&String> = self.members.keys().collect();
        order.sort_by_key(|member| std::cmp::Reverse(owned.get(member.as_str()).copied()));
        let quota: HashMap<String, usize> = order
            .iter()
            .enumerate()
            .map(|(rank, member)| ((*member).clone(), base + usize::from(rank < extra)))
            .collect();
        // Release the excess, highest partitions first.
        let mut kept: HashMap<String, usize> = HashMap::new();
        for (owner, epoch) in self.owners.iter_mut().zip(&mut self.epochs) {
            if let Some(member) = owner {
                let count = kept.entry(member.clone()).or_default();
                if *count < quota[member.as_str()] {
                    *count += 1;
                } else {
                    *owner = None;
                    *epoch += 1;
                }
            }
        }
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
        for (owner, epoch) in self.owners.iter_mut().zip(&mut self.epochs) {
            if owner.is_none()
                && let Some(member) = takers.next()
            {
                *owner = Some(member);
                *epoch += 1;
            }
        }
    }

    /// What `member` owns now, with epochs and start offsets.
    pub fn assignment(&self, member: &str) -> Assignment {
        Assignment {
            generation: self.generation,
            partitions: self
                .owners
                .iter()
                .enumerate()
                .filter(|(_, owner)| owner.as_deref() == Some(member))
                .map(|(partition, _)| PartitionAssignment {
                    partition: u32::try_from(partition).unwrap_or(u32::MAX),
                    epoch: self.epochs[partition],
                    start_offset: self.committed[partition],
                })
                .collect(),
        }
    }

    /// Checks a commit of `partition` by `member` under `epoch`.
    pub fn check_commit(
        &self,
        member: &str,
        partition: u32,
        epoch: u64,
    ) -> Result<(), CommitRefusal> {
        let Some(owner) = self.owners.get(partition as usize) else {
            return Err(CommitRefusal::Invalid(format!(
                "partition {partition} does not exist; the topic has {} partitions",
                self.partitions
            )));
        };
        let current = self.epochs[partition as usize];
        if owner.as_deref() != Some(member) || current != epoch {
            return Err(CommitRefusal::Fenced(format!(
                "partition {partition}: member '{member}' with epoch {epoch} no longer owns it \
                 (epoch now {current}); drop its in-flight work, the new owner redelivers from \
                 the last commit"
            )));
        }
        Ok(())
    }

    /// Records a checked commit; committed offsets never go back.
    pub fn commit(&mut self, partition: u32, next_offset: u64) {
        let slot = &mut self.committed[partition as usize];
        *slot = (*slot).max(next_offset);
    }

    /// Every partition's committed offset.
    pub fn committed(&self) -> &[u64] {
        &self.committed
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

/// One group with the watch channels of its members' streams.
#[derive(Debug)]
pub struct Group {
    /// The coordinator.
    pub state: GroupState,
    /// The topic.
    pub topic: Arc<Topic>,
    name: String,
    watchers: HashMap<String, (u64, watch::Sender<Arc<Assignment>>)>,
}

impl Group {
    /// Sends each member its assignment if it changed.
    fn publish(&mut self) {
        let state = &self.state;
        self.watchers.retain(|member, (session, sender)| {
            if !state.is_member(member, *session) {
                return false;
            }
            let assignment = state.assignment(member);
            sender.send_if_modified(|current| {
                if current.partitions == assignment.partitions {
                    return false;
                }
                *current = Arc::new(assignment);
                true
            });
            true
        });
    }

    fn commit_queue(&self) -> Vec<u8> {
        commit_queue(&self.name, &self.topic.name)
    }
}

/// The commit queue of `group` on `topic`.
pub fn commit_queue(group: &str, topic: &str) -> Vec<u8> {
    let mut name = COMMIT_PREFIX.to_vec();
    name.extend_from_slice(group.as_bytes());
    name.push(0);
    name.extend_from_slice(topic.as_bytes());
    name
}

fn encode_committed(committed: &[u64]) -> Vec<u8> {
    let mut record = Vec::with_capacity(4 + committed.len() * 8);
    record.extend_from_slice(&u32::try_from(committed.len()).unwrap_or(0).to_le_bytes());
    for offset in committed {
        record.extend_from_slice(&offset.to_le_bytes());
    }
    record
}

fn decode_committed(record: &[u8]) -> Vec<u64> {
    record
        .get(4..)
        .unwrap_or_default()
        .chunks_exact(8)
        .map(|bytes| u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8])))
        .collect()
}

/// A member's handle on its group.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The group.
    pub group: Arc<Mutex<Group>>,
    /// The member id.
    pub member: String,
    /// This stream's session.
    pub session: u64,
    /// Its assignment, updated on every rebalance that changes it.
    pub assignment: watch::Receiver<Arc<Assignment>>,
}

/// Groups by (group, topic).
type GroupMap = HashMap<(String, String), Arc<Mutex<Group>>>;

/// Every consumer group on the server.
#[derive(Debug, Default)]
pub struct Groups {
    groups: Mutex<GroupMap>,
    sessions: std::sync::atomic::AtomicU64,
}

impl Groups {
    /// The group, loaded with its committed offsets if new (reads the store).
    fn group(
        &self,
        store: &Store,
        group: &str,
        topic: &Arc<Topic>,
    ) -> Result<Arc<Mutex<Group>>, WireError> {
        let key = (group.to_owned(), topic.name.clone());
        if let Some(existing) = lock(&self.groups).get(&key) {
            return Ok(Arc::clone(existing));
        }
        // Loaded outside the lock: the read may wait for a commit round (`last_record`).
        let committed = super::last_record(store, &commit_queue(group, &topic.name))?
            .map(|record| decode_committed(&record))
            .unwrap_or_default();
        let mut groups = lock(&self.groups);
        if let Some(existing) = groups.get(&key) {
            return Ok(Arc::clone(existing));
        }
        if groups.len() >= GROUPS_MAX {
            return Err(WireError::new(
                ErrorCode::ResourceExhausted,
                format!("{GROUPS_MAX} consumer groups exist on this server, the most it holds"),
            ));
        }
        let created = Arc::new(Mutex::new(Group {
            state: GroupState::new(topic.partitions(), committed),
            topic: Arc::clone(topic),
            name: group.to_owned(),
            watchers: HashMap::new(),
        }));
        groups.insert(key, Arc::clone(&created));
        Ok(created)
    }

    /// Looks a group up: in memory, or loaded from its commits if it ever committed on
    /// `topic` (also before a restart). `None` if it never did.
    pub fn find(
        &self,
        store: &Store,
        group: &str,
        topic: &Arc<Topic>,
    ) -> Result<Option<Arc<Mutex<Group>>>, WireError> {
        let key = (group.to_owned(), topic.name.clone());
        if let Some(found) = lock(&self.groups).get(&key) {
            return Ok(Some(Arc::clone(found)));
        }
        let committed = store
            .queue_info(&commit_queue(group, &topic.name))
            .map_err(|error| storage_error(&error))?;
        match committed {
            Some(_) => self.group(store, group, topic).map(Some),
            None => Ok(None),
        }
    }

    /// Joins `member` to `group` on `topic`. Blocks on the store (first load).
    pub fn join(
        &self,
        store: &Store,
        group: &str,
        topic: &Arc<Topic>,
        member: &str,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<Membership, WireError> {
        let handle = self.group(store, group, topic)?;
        let session = self
            .sessions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut locked = lock(&handle);
        if locked.state.members.len() >= MEMBERS_MAX && !locked.state.members.contains_key(member) {
            return Err(WireError::new(
                ErrorCode::ResourceExhausted,
                format!("group '{group}' has {MEMBERS_MAX} members, the most it holds"),
            ));
        }
        locked.state.join(member, session, lease_ms, now_ms);
        let (sender, receiver) = watch::channel(Arc::new(locked.state.assignment(member)));
        // Replaces an older stream of the same member: dropping its sender ends it.
        locked.watchers.insert(member.to_owned(), (session, sender));
        locked.publish();
        drop(locked);
        Ok(Membership {
            group: handle,
            member: member.to_owned(),
            session,
            assignment: receiver,
        })
    }
}

impl Membership {
    /// Leaves the group (if still a member) and rebalances the rest.
    pub fn leave(&self) {
        let mut group = lock(&self.group);
        if group.state.leave(&self.member, self.session) {
            group.watchers.remove(&self.member);
            group.publish();
        }
    }

    /// Renews the lease; false if this stream is no longer a member.
    pub fn renew(&self, now_ms: u64) -> bool {
        lock(&self.group)
            .state
            .renew(&self.member, self.session, now_ms)
    }

    /// Applies commits, each `(partition, epoch, next_offset)`, and appends the new snapshot to
    /// the group's commit queue. Returns each commit's refusal (if any) and, if anything was
    /// committed, the ticket that makes it durable. `end_of` gives a partition's next offset.
    pub fn commit(
        &self,
        store: &Store,
        commits: &[(u32, u64, u64)],
    ) -> Result<(Vec<Option<WireError>>, Option<CommitTicket>), WireError> {
        let mut group = lock(&self.group);
        let mut results = Vec::with_capacity(commits.len());
        let mut changed = false;
        for &(partition, epoch, next_offset) in commits {
            let refusal = match group.state.check_commit(&self.member, partition, epoch) {
                Err(CommitRefusal::Fenced(message)) => {
                    Some(WireError::new(ErrorCode::Fenced, message))
                }
                Err(CommitRefusal::Invalid(message)) => {
                    Some(WireError::new(ErrorCode::InvalidArgument, message))
                }
                Ok(()) => {
                    let queue = &group.topic.queues[partition as usize];
                    let end = store
                        .queue_info(queue)
                        .map_err(|error| storage_error(&error))?
                        .map_or(0, |info| info.next_offset);
                    if next_offset > end {
                        Some(WireError::new(
                            ErrorCode::OffsetOutOfRange,
                            format!(
                                "partition {partition}: commit of offset {next_offset} is past \
                                 its end {end}; commit only delivered messages"
                            ),
                        ))
                    } else {
                        group.state.commit(partition, next_offset);
                        changed = true;
                        None
                    }
                }
            };
            results.push(refusal);
        }
        let mut ticket = None;
        if changed {
            let record = encode_committed(group.state.committed());
            let queue = group.commit_queue();
            let (_, appended) = store
                .append_deferred(&queue, &record)
                .map_err(write_error)?;
            ticket = Some(appended);
        }
        Ok((results, ticket))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(state: &GroupState) -> Vec<Option<String>> {
        state
            .owners()
            .map(|(owner, _)| owner.map(str::to_owned))
            .collect()
    }

    fn count(state: &GroupState, member: &str) -> usize {
        state.assignment(member).partitions.len()
    }

    #[test]
    fn given_a_commit_not_yet_fsynced_under_always_then_loading_the_group_waits_for_it() {
        let directory = tempfile::tempdir().unwrap();
        let options = levee_store::StoreOptions {
            sync: levee_store::SyncPolicy::Always,
            ..levee_store::StoreOptions::default()
        };
        let (store, _) = Store::open(directory.path(), options).unwrap();
        let topic = Arc::new(Topic::new("t", 2));
        let queue = commit_queue("g", "t");
        store.append(&queue, &encode_committed(&[1, 2])).unwrap();
        // The newest commit is buffered and its round not started: unreadable under `always`.
        store
            .append_deferred(&queue, &encode_committed(&[5, 6]))
            .unwrap();
        let groups = Groups::default();
        let group = groups.find(&store, "g", &topic).unwrap().unwrap();
        assert_eq!(lock(&group).state.committed(), [5, 6]);
        assert!(groups.find(&store, "never", &topic).unwrap().is_none());
    }

    #[test]
    fn given_joins_then_partitions_split_evenly_and_only_the_needed_ones_move() {
        let mut state = GroupState::new(8, vec![]);
        state.join("a", 1, 10_000, 0);
        assert_eq!(count(&state, "a"), 8);
        let before = owners(&state);
        state.join("b", 2, 10_000, 0);
        assert_eq!((count(&state, "a"), count(&state, "b")), (4, 4));
        let moved = before
            .iter()
            .zip(owners(&state))
            .filter(|(old, new)| *old != new)
            .count();
        assert_eq!(moved, 4, "only b's share moves");
        let before = owners(&state);
        state.join("c", 3, 10_000, 0);
        let sizes = [count(&state, "a"), count(&state, "b"), count(&state, "c")];
        assert_eq!(sizes.iter().sum::<usize>(), 8);
        assert!(sizes.iter().all(|size| (2..=3).contains(size)), "{sizes:?}");
        let moved = before
            .iter()
            .zip(owners(&state))
            .filter(|(old, new)| *old != new)
            .count();
        assert_eq!(moved, 2, "c takes 2: one from a, one from b");
    }

    #[test]
    fn given_leave_and_expiry_then_the_rest_take_over_with_new_epochs() {
        let mut state = GroupState::new(4, vec![7, 0, 0, 3]);
        state.join("a", 1, 1_000, 0);
        state.join("b", 2, 5_000, 0);
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
                Err(CommitRefusal::Fenced(_))
            ));
        }
        assert!(state.leave("b", 2));
        assert!(owners(&state).iter().all(Option::is_none));
    }

    #[test]
    fn given_rejoin_of_same_member_then_old_epochs_are_fenced() {
        let mut state = GroupState::new(2, vec![]);
        state.join("a", 1, 1_000, 0);
        let old = state.assignment("a").partitions[0];
        state.join("a", 2, 1_000, 0);
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
    fn given_commits_then_offsets_never_go_back() {
        let mut state = GroupState::new(1, vec![]);
        state.commit(0, 10);
        state.commit(0, 4);
        assert_eq!(state.committed(), &[10]);
        assert_eq!(
            decode_committed(&encode_committed(&[1, 2, 3])),
            vec![1, 2, 3]
        );
    }

    proptest::proptest! {
        /// Whatever joins, leaves and expiries happen, every partition has exactly one owner
        /// among the live members (when there is one), and loads differ by at most one.
        #[test]
        fn given_any_membership_changes_then_each_partition_has_one_live_owner(
            partitions in 1_u32..40,
            steps in proptest::collection::vec((0_u8..3, 0_usize..6), 1..60),
        ) {
            let mut state = GroupState::new(partitions, vec![]);
            let mut sessions: HashMap<String, u64> = HashMap::new();
            for (step, (action, member)) in steps.into_iter().enumerate() {
                let name = format!("m{member}");
                let now = step as u64 * 100;
                match action {
                    0 => {
                        sessions.insert(name.clone(), step as u64);
                        state.join(&name, step as u64, 250, now);
                    }
                    1 => {
                        if let Some(session) = sessions.remove(&name) {
                            proptest::prop_assert!(state.leave(&name, session));
                        }
                    }
                    _ => {
                        for expired in state.expire(now) {
                            sessions.remove(&expired);
                        }
                    }
                }
                let live: Vec<&String> = sessions.keys().collect();
                let mut loads: HashMap<&str, usize> = HashMap::new();
                for (owner, _) in state.owners() {
                    match owner {
                        Some(owner) => {
                            proptest::prop_assert!(live.iter().any(|m| m.as_str() == owner));
                            *loads.entry(owner).or_default() += 1;
                        }
                        None => proptest::prop_assert!(live.is_empty()),
                    }
                }
                if !live.is_empty() {
                    let most = loads.values().max().copied().unwrap_or(0);
                    let least = live.iter().map(|m| loads.get(m.as_str()).copied().unwrap_or(0)).min().unwrap_or(0);
                    proptest::prop_assert!(most - least <= 1, "{loads:?}");
                }
            }
        }
    }
}
