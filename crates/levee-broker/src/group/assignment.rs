//! [`Assignment`]: the partitions one member of a group owns, as its stream is told.

/// One partition a member owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionAssignment {
    /// The partition number.
    pub partition: u32,
    /// The epoch its commits must carry.
    pub epoch: u64,
    /// The group's committed offset on it: where delivery starts.
    pub start_offset: u64,
    /// The group's committed offset on the partition's retry queue (retries that came due).
    pub retry_start_offset: u64,
}

/// What a member owns after the group's latest rebalance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Assignment {
    /// The group's generation, raised on every rebalance.
    pub generation: u64,
    /// The partitions it owns, by partition number.
    pub partitions: Vec<PartitionAssignment>,
}
