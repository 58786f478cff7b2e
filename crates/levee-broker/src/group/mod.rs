//! Consumer groups, as the state machine that decides them. It owns
//!
//! - [`GroupCoordinator`] (`coordinator`): one group on one topic: members and their leases,
//!   who owns which partition under which epoch, committed offsets, sticky rebalancing and
//!   fencing;
//! - [`Assignment`] (`assignment`): what one member owns, as its stream is told;
//! - the logged snapshot of a group's committed offsets (`committed`);
//! - [`GroupError`]: why a join or a commit was refused.
//!
//! Every call takes the current time as an argument and does no I/O, so rebalancing, leases
//! and fencing are tested with virtual time, and every replica fed the same calls decides the
//! same.

mod assignment;
mod committed;
mod coordinator;

pub use assignment::{Assignment, PartitionAssignment};
pub use committed::{decode_committed, encode_committed};
pub use coordinator::{Commit, CommitOutcome, GroupCoordinator};

/// Most members of one group.
pub const MEMBERS_MAX: usize = 1_024;
/// Most groups on one server.
pub const GROUPS_MAX: usize = 10_000;

/// Why a group refused a join or a commit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    /// The group holds [`MEMBERS_MAX`] members and this one would be one more.
    #[error("the group has {MEMBERS_MAX} members, the most it holds")]
    MembersFull,
    /// The member does not own the partition under that epoch (a stale owner).
    #[error(
        "partition {partition}: member '{member}' with epoch {epoch} no longer owns it (epoch \
         now {current}); drop its in-flight work, the new owner redelivers from the last commit"
    )]
    Fenced {
        /// The partition.
        partition: u32,
        /// The member that committed.
        member: String,
        /// The epoch it committed under.
        epoch: u64,
        /// The partition's epoch now.
        current: u64,
    },
    /// A partition number out of range.
    #[error("partition {partition} does not exist; the topic has {partitions} partitions")]
    NoSuchPartition {
        /// The partition given.
        partition: u32,
        /// The topic's partition count.
        partitions: u32,
    },
    /// A commit past the partition's end.
    #[error(
        "partition {partition}{}: commit of offset {next_offset} is past its end {end}; commit \
         only delivered messages",
        if *retry { " (its retry queue)" } else { "" }
    )]
    PastEnd {
        /// The partition.
        partition: u32,
        /// The offset committed.
        next_offset: u64,
        /// The partition's next offset.
        end: u64,
        /// The commit was of the partition's retry queue.
        retry: bool,
    },
    /// An offset reset while members consume.
    #[error(
        "the group has {members} active members; stop them first, or force the reset (their \
         streams end and they join again at the new offsets)"
    )]
    MembersActive {
        /// How many.
        members: usize,
    },
}
