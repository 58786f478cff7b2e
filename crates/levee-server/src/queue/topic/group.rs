//! Consumer groups over the store: the broker engine's [`GroupCoordinator`] decides joins,
//! leases, rebalances, fencing and commits; this module keeps every group, loads committed
//! offsets from the store, logs each accepted commit batch as a snapshot record in the queue
//! `\0commit\0{group}\0{topic}` (only the last record matters, so the queue is trimmed like
//! consumer positions), and tells each member's stream its assignment through a watch
//! channel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use levee_broker::group::{Commit, GROUPS_MAX, GroupCoordinator, decode_committed};
use levee_broker::names::{commit_queue, retry_queue};
use levee_proto::WireError;
use levee_proto::v1::{Assignment, ErrorCode, PartitionAssignment};
use levee_store::{CommitTicket, Store};
use tokio::sync::watch;

use crate::queue::topic::catalog::Topic;
use crate::queue::{group_error, lock, storage_error, write_error};

/// A member's assignment as its stream sends it.
fn to_wire(assignment: levee_broker::group::Assignment) -> Assignment {
    Assignment {
        generation: assignment.generation,
        partitions: assignment
            .partitions
            .into_iter()
            .map(|owned| PartitionAssignment {
                partition: owned.partition,
                epoch: owned.epoch,
                start_offset: owned.start_offset,
                retry_start_offset: owned.retry_start_offset,
            })
            .collect(),
    }
}

/// One group with the watch channels of its members' streams.
#[derive(Debug)]
pub struct Group {
    /// The coordinator.
    pub state: GroupCoordinator,
    /// The topic.
    pub topic: Arc<Topic>,
    name: String,
    watchers: HashMap<String, (u64, watch::Sender<Arc<Assignment>>)>,
    /// In a replicated cluster, the term of the topic's shard this node coordinates the group
    /// in (0 elsewhere): a group loaded in another term is loaded again.
    term: u64,
    /// Ended: its members' streams were ended, and the next join loads it again.
    retired: bool,
    /// Held while a commit snapshot is written through the shard, so the snapshots reach the
    /// log in the order they were taken.
    turn: Arc<tokio::sync::Mutex<()>>,
}

impl Group {
    /// Sends each member its assignment if it changed.
    fn publish(&mut self) {
        let state = &self.state;
        self.watchers.retain(|member, (session, sender)| {
            if !state.is_member(member, *session) {
                return false;
            }
            let assignment = to_wire(state.assignment(member));
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

    /// The lock held while a commit snapshot of the group is written through its shard.
    pub fn turn(&self) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(&self.turn)
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Ends every member's stream (they join again) and has the next join load the group
    /// again from its commits.
    pub fn retire(&mut self) {
        self.retired = true;
        self.watchers.clear();
    }

    /// The next offset of `partition`'s queue, or of its retry queue with `retry`.
    fn end_of_queue(
        group: &str,
        topic: &Topic,
        store: &Store,
        partition: u32,
        retry: bool,
    ) -> Result<u64, WireError> {
        let queue = if retry {
            retry_queue(group, &topic.name, partition)
        } else {
            topic.queues[partition as usize].clone()
        };
        store
            .queue_info(&queue)
            .map(|info| info.map_or(0, |info| info.next_offset))
            .map_err(|error| storage_error(&error))
    }

    /// Sets the committed offsets in `offsets` (see [`GroupCoordinator::reset`]): with
    /// `force`, ends the members' streams first. Logs the snapshot record here (buffered)
    /// with `log_here`, else hands it back to be written through the shard; returns the
    /// members whose streams were ended and what makes the reset durable.
    pub fn reset(
        &mut self,
        store: &Store,
        offsets: &[(u32, u64)],
        (force, log_here): (bool, bool),
    ) -> Result<(usize, Logged), WireError> {
        let members = self.state.member_count();
        let record = self
            .state
            .reset(offsets, force)
            .map_err(|error| group_error(&self.name, &error))?;
        // Dropping their senders ends the members' streams: they join again.
        self.watchers.clear();
        Ok((members, self.log(store, record, log_here)?))
    }

    /// Logs a snapshot `record` in the commit queue here (buffered) with `log_here`, else
    /// hands it back to be written through the shard.
    fn log(&self, store: &Store, record: Vec<u8>, log_here: bool) -> Result<Logged, WireError> {
        if !log_here {
            return Ok(Logged::Shard(self.commit_queue(), record));
        }
        let (_, ticket) = store
            .append_deferred(&self.commit_queue(), &record)
            .map_err(write_error)?;
        Ok(Logged::Here(ticket))
    }
}

/// Where a group's new commit snapshot went.
#[derive(Debug)]
pub enum Logged {
    /// Buffered in this node's store: the ticket makes it durable.
    Here(CommitTicket),
    /// To be written to this commit queue through the topic's shard (a replicated cluster).
    Shard(Vec<u8>, Vec<u8>),
}

/// What a commit batch answers.
#[derive(Debug)]
pub struct CommitAnswers {
    /// Per commit: the partition's committed offset after the batch, or why it was refused.
    pub results: Vec<Result<u64, WireError>>,
    /// Where the batch's snapshot went, if anything was committed.
    pub logged: Option<Logged>,
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
    /// The group, loaded with its committed offsets if new, retired, or loaded in another
    /// `term` (reads the store). `term` is the topic's shard's term this node coordinates
    /// the group in (0 on a server whose queues are not replicated).
    pub fn group(
        &self,
        store: &Store,
        group: &str,
        topic: &Arc<Topic>,
        term: u64,
    ) -> Result<Arc<Mutex<Group>>, WireError> {
        let key = (group.to_owned(), topic.name.clone());
        let current = |groups: &GroupMap| {
            groups
                .get(&key)
                .filter(|existing| {
                    let existing = lock(existing);
                    existing.term == term && !existing.retired
                })
                .cloned()
        };
        if let Some(existing) = current(&lock(&self.groups)) {
            return Ok(existing);
        }
        // Loaded outside the lock: the read may wait for a commit round (`last_record`).
        let committed = crate::queue::last_record(store, &commit_queue(group, &topic.name))?
            .map(|record| decode_committed(&record))
            .unwrap_or_default();
        let mut groups = lock(&self.groups);
        if let Some(existing) = current(&groups) {
            return Ok(existing);
        }
        if let Some(stale) = groups.remove(&key) {
            lock(&stale).retire();
        }
        if groups.len() >= GROUPS_MAX {
            return Err(WireError::new(
                ErrorCode::ResourceExhausted,
                format!("{GROUPS_MAX} consumer groups exist on this server, the most it holds"),
            ));
        }
        let created = Arc::new(Mutex::new(Group {
            state: GroupCoordinator::new(topic.partitions(), committed),
            topic: Arc::clone(topic),
            name: group.to_owned(),
            watchers: HashMap::new(),
            term,
            retired: false,
            turn: Arc::default(),
        }));
        groups.insert(key, Arc::clone(&created));
        Ok(created)
    }

    /// Drops every member whose lease ran out by `now_ms` (a stream stuck sending to a client
    /// that stopped reading renews nothing) and hands its partitions to the others, with new
    /// epochs; the dropped member's stream learns it when it next looks. Returns how many
    /// members were dropped.
    pub fn expire_leases(&self, now_ms: u64) -> usize {
        let groups: Vec<Arc<Mutex<Group>>> = lock(&self.groups).values().cloned().collect();
        let mut dropped = 0;
        for handle in groups {
            let mut group = lock(&handle);
            let expired = group.state.expire(now_ms);
            if expired.is_empty() {
                continue;
            }
            for member in &expired {
                tracing::info!(group = %group.name, %member, "consumer lease ran out");
                group.watchers.remove(member);
            }
            dropped += expired.len();
            group.publish();
        }
        dropped
    }

    /// Each loaded group's retry queues with the group's committed offset on them (above 0):
    /// what retention may remove below.
    pub fn retry_offsets(&self) -> HashMap<Vec<u8>, u64> {
        let groups: Vec<Arc<Mutex<Group>>> = lock(&self.groups).values().cloned().collect();
        let mut offsets = HashMap::new();
        for handle in groups {
            let group = lock(&handle);
            for (partition, &committed) in (0_u32..).zip(group.state.retry_committed()) {
                if committed > 0 {
                    offsets.insert(
                        retry_queue(&group.name, &group.topic.name, partition),
                        committed,
                    );
                }
            }
        }
        offsets
    }

    /// Looks a group up: in memory, or loaded from its commits (in `term`, see
    /// [`Groups::group`]) if it ever committed on `topic` (also before a restart). `None` if
    /// it never did.
    pub fn find(
        &self,
        store: &Store,
        group: &str,
        topic: &Arc<Topic>,
        term: u64,
    ) -> Result<Option<Arc<Mutex<Group>>>, WireError> {
        let key = (group.to_owned(), topic.name.clone());
        if lock(&self.groups).contains_key(&key) {
            return self.group(store, group, topic, term).map(Some);
        }
        let committed = store
            .queue_info(&commit_queue(group, &topic.name))
            .map_err(|error| storage_error(&error))?;
        match committed {
            Some(_) => self.group(store, group, topic, term).map(Some),
            None => Ok(None),
        }
    }

    /// Joins `member` to `group` on `topic`, coordinated in `term` (see
    /// [`Groups::group`]). Blocks on the store (first load).
    pub fn join(
        &self,
        store: &Store,
        (group, topic, term): (&str, &Arc<Topic>, u64),
        member: &str,
        (lease_ms, now_ms): (u64, u64),
    ) -> Result<Membership, WireError> {
        let handle = self.group(store, group, topic, term)?;
        let session = self
            .sessions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut locked = lock(&handle);
        locked
            .state
            .join(member, session, lease_ms, now_ms)
            .map_err(|error| group_error(group, &error))?;
        let (sender, receiver) = watch::channel(Arc::new(to_wire(locked.state.assignment(member))));
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

    /// Whether the member id belongs to another stream now (it joined again).
    pub fn replaced(&self) -> bool {
        let group = lock(&self.group);
        group
            .state
            .members()
            .any(|(member, _)| member == self.member)
            && !group.state.is_member(&self.member, self.session)
    }

    /// The lock held while a commit snapshot of the group is written through its shard.
    pub fn turn(&self) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(&lock(&self.group).turn)
    }

    /// Ends the streams of every member of the group (see [`Group::retire`]).
    pub fn retire(&self) {
        lock(&self.group).retire();
    }

    /// Applies a commit batch and logs the group's new snapshot (see [`Group::reset`] for
    /// `log_here`). Returns, per commit, the partition's committed offset after the batch or
    /// why it was refused, and, if anything was committed, where the snapshot went.
    pub fn commit(
        &self,
        store: &Store,
        commits: &[Commit],
        log_here: bool,
    ) -> Result<CommitAnswers, WireError> {
        let mut group = lock(&self.group);
        let group = &mut *group;
        let outcome = group
            .state
            .commit_batch(&self.member, commits, |partition, retry| {
                Group::end_of_queue(&group.name, &group.topic, store, partition, retry)
            })?;
        let logged = match outcome.record {
            Some(record) => Some(group.log(store, record, log_here)?),
            None => None,
        };
        // An accepted commit is answered with the partition's committed offset after the
        // batch: a commit below it changed nothing, and the answer says so.
        let (committed, retry_committed) = (group.state.committed(), group.state.retry_committed());
        let results = commits
            .iter()
            .zip(outcome.refusals)
            .map(|(commit, refusal)| match refusal {
                Some(error) => Err(group_error(&group.name, &error)),
                None if commit.retry => Ok(retry_committed[commit.partition as usize]),
                None => Ok(committed[commit.partition as usize]),
            })
            .collect();
        Ok(CommitAnswers { results, logged })
    }
}

#[cfg(test)]
mod tests {
    use levee_broker::group::encode_committed;

    use super::*;

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
        let group = groups.find(&store, "g", &topic, 0).unwrap().unwrap();
        assert_eq!(lock(&group).state.committed(), [5, 6]);
        assert!(groups.find(&store, "never", &topic, 0).unwrap().is_none());
    }

    #[test]
    fn given_a_group_loaded_in_one_term_when_joined_in_the_next_then_it_is_loaded_again_from_the_log()
     {
        let directory = tempfile::tempdir().unwrap();
        let (store, _) =
            Store::open(directory.path(), levee_store::StoreOptions::default()).unwrap();
        let topic = Arc::new(Topic::new("t", 2));
        let groups = Groups::default();
        let old = groups
            .join(&store, ("g", &topic, 1), "a", (10_000, 0))
            .unwrap();
        // The shard applied another coordinator's snapshot.
        store
            .append(&commit_queue("g", "t"), &encode_committed(&[3, 4, 1, 0]))
            .unwrap();
        let same = groups
            .join(&store, ("g", &topic, 1), "b", (10_000, 0))
            .unwrap();
        assert!(
            Arc::ptr_eq(&old.group, &same.group),
            "same term, same group"
        );
        let new = groups
            .join(&store, ("g", &topic, 2), "c", (10_000, 0))
            .unwrap();
        assert!(
            !Arc::ptr_eq(&old.group, &new.group),
            "a new term loads it again"
        );
        // The old term's streams are ended (their assignment channels closed).
        assert!(old.assignment.has_changed().is_err());
        assert!(same.assignment.has_changed().is_err());
        let group = lock(&new.group);
        assert_eq!(group.state.committed(), [3, 4]);
        assert_eq!(group.state.retry_committed(), [1, 0]);
        drop(group);
        // A retired group is loaded again too.
        new.retire();
        assert!(new.assignment.has_changed().is_err());
        let again = groups
            .join(&store, ("g", &topic, 2), "c", (10_000, 0))
            .unwrap();
        assert!(!Arc::ptr_eq(&new.group, &again.group));
    }
}
