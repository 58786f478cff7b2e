//! Shards (docs/CLUSTER.md, "Part 2"): a cluster's queues are spread over `S` shards, `S` fixed
//! when the cluster is created, and each shard is placed on up to [`REPLICAS_MAX`] of the
//! voters. Every client computes both the same way:
//!
//! - [`shard_of`]: `XXH3_64(routing name, seed 0) mod S`, over the name's UTF-8 bytes. The
//!   routing name is the queue's name for a plain queue or a mailbox, and the topic's name for a
//!   topic's partitions (a topic and its groups' state live in one shard).
//! - [`replicas`]: the voters with the highest scores `XXH3_64(node id as 8 little-endian
//!   bytes, seed = shard)`, highest first (a tie: the lower node id first), so adding or
//!   removing a voter moves only the shards that score it among their highest.

/// Shards of a cluster created without the `shards` setting.
pub const SHARDS_DEFAULT: u32 = 16;
/// The most shards a cluster may have.
pub const SHARDS_MAX: u32 = 1_024;
/// The most replicas of a shard.
pub const REPLICAS_MAX: usize = 3;

/// The shard of `routing_name` in a cluster of `shards` shards.
///
/// # Panics
/// If `shards` is 0 (a cluster has at least one shard).
pub fn shard_of(routing_name: &str, shards: u32) -> u32 {
    shard_of_bytes(routing_name.as_bytes(), shards)
}

/// [`shard_of`] for a name given as bytes (a queue's name need not be UTF-8).
///
/// # Panics
/// If `shards` is 0 (a cluster has at least one shard).
pub fn shard_of_bytes(routing_name: &[u8], shards: u32) -> u32 {
    assert!(shards > 0, "a cluster has at least one shard");
    let shard = xxhash_rust::xxh3::xxh3_64(routing_name) % u64::from(shards);
    u32::try_from(shard).unwrap_or_default()
}

/// The voters (of `voters`, node ids) that hold shard `shard`: at most [`REPLICAS_MAX`], the
/// first one preferred.
pub fn replicas(shard: u32, voters: &[u64]) -> Vec<u64> {
    let mut scored: Vec<(u64, u64)> = voters
        .iter()
        .map(|node| {
            let score = xxhash_rust::xxh3::xxh3_64_with_seed(&node.to_le_bytes(), u64::from(shard));
            (score, *node)
        })
        .collect();
    scored.sort_unstable_by(|left, right| right.0.cmp(&left.0).then(left.1.cmp(&right.1)));
    scored.dedup_by_key(|(_, node)| *node);
    scored
        .into_iter()
        .take(REPLICAS_MAX)
        .map(|(_, node)| node)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names and voter sets of the shared vectors (conformance/vectors/shards.json).
    fn vector_inputs() -> (Vec<String>, Vec<u32>, Vec<Vec<u64>>) {
        let mut names: Vec<String> = ["", "orders", "payments", "user:1", "topic-α", "a"]
            .iter()
            .map(|name| (*name).to_owned())
            .collect();
        names.extend((0..20).map(|number| format!("queue-{number}")));
        let counts = vec![1, 2, 3, 16, 64, 1_024];
        let voters = vec![
            vec![1],
            vec![1, 2],
            vec![1, 2, 3],
            vec![3, 1, 2, 5, 4],
            vec![7, 1_000_000, 42, 9, 13, 100],
        ];
        (names, counts, voters)
    }

    /// The shared vectors as JSON, one entry a line.
    fn vectors_json() -> String {
        let (names, counts, voters) = vector_inputs();
        let quoted: Vec<String> = names
            .iter()
            .map(|name| serde_json::Value::String(name.clone()).to_string())
            .collect();
        let shard_lines: Vec<String> = counts
            .iter()
            .map(|count| {
                let shards: Vec<String> = names
                    .iter()
                    .map(|name| shard_of(name, *count).to_string())
                    .collect();
                format!(
                    "    {{\"shards\": {count}, \"shard_of\": [{}]}}",
                    shards.join(", ")
                )
            })
            .collect();
        let replica_lines: Vec<String> = voters
            .iter()
            .map(|set| {
                let placed: Vec<String> = (0..16)
                    .map(|shard| format!("{:?}", replicas(shard, set)))
                    .collect();
                format!(
                    "    {{\"voters\": {set:?}, \"replicas_of_shards_0_to_15\": [{}]}}",
                    placed.join(", ")
                )
            })
            .collect();
        format!(
            "{{\n  \"names\": [{}],\n  \"shard_of\": [\n{}\n  ],\n  \"replicas\": [\n{}\n  ]\n}}\n",
            quoted.join(", "),
            shard_lines.join(",\n"),
            replica_lines.join(",\n")
        )
    }

    #[test]
    fn given_the_shared_vectors_then_this_code_computes_them() {
        // To print them again: cargo test -p levee-proto print_shard_vectors -- --ignored
        // --nocapture > conformance/vectors/shards.json (then drop cargo's lines).
        let file = include_str!("../../../conformance/vectors/shards.json");
        assert_eq!(file, vectors_json());
    }

    #[test]
    #[ignore = "prints the vectors file"]
    fn print_shard_vectors() {
        print!("{}", vectors_json());
    }

    #[test]
    fn given_names_then_shards_match_the_published_vectors() {
        // Pinned here and in docs/CLUSTER.md, so other clients can check their own.
        assert_eq!(shard_of("", 16), (0x2d06_8005_38d3_94c2_u64 % 16) as u32);
        assert_eq!(shard_of("orders", 1), 0);
        let spread: std::collections::BTreeSet<u32> = (0..1_000)
            .map(|i| shard_of(&format!("queue-{i}"), 16))
            .collect();
        assert_eq!(spread.len(), 16, "a thousand names reach every shard");
    }

    #[test]
    fn given_a_voter_added_then_only_shards_that_score_it_highest_move() {
        let before: Vec<Vec<u64>> = (0..64)
            .map(|shard| replicas(shard, &[1, 2, 3, 4]))
            .collect();
        let after: Vec<Vec<u64>> = (0..64)
            .map(|shard| replicas(shard, &[1, 2, 3, 4, 5]))
            .collect();
        for (old, new) in before.iter().zip(&after) {
            assert_eq!(old.len(), 3);
            if new.contains(&5) {
                // The newcomer took one place; the others kept theirs, in order.
                let kept: Vec<u64> = new.iter().copied().filter(|node| *node != 5).collect();
                assert_eq!(kept, old[..2].to_vec());
            } else {
                assert_eq!(
                    old, new,
                    "a shard the newcomer does not score among its best stays"
                );
            }
        }
        let moved = after.iter().filter(|new| new.contains(&5)).count();
        assert!((20..=55).contains(&moved), "about 3/5 of 64: {moved}");
        // Fewer voters than replicas: every voter holds every shard.
        assert_eq!(replicas(7, &[2, 1]).len(), 2);
        assert!(replicas(7, &[]).is_empty());
    }
}
