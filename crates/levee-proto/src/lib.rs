//! Levee's wire types, generated at build time from the `.proto` files under `proto/`, which
//! are the API's single source of truth (the Java and Python clients generate from the same
//! files).
//!
//! - [`v1`]: messages, gRPC clients and gRPC servers of the `levee.v1` package.
//! - [`WireError`]: the wire error codes, how each maps to a gRPC status, and how a client reads
//!   them back out of a `tonic::Status`.
//! - [`json`]: the JSON forms the admin HTTP port answers and the CLI prints.
//! - [`topic_partition`]: the partition a key is published to, which every client computes
//!   identically; [`shards`]: the shard of a queue and the voters that hold it.

pub mod json;
pub mod limits_json;
pub mod shards;
mod wire_error;

/// The type of message payloads on the wire: a decoded payload is a slice of the received
/// frame, and an encoded one may share a buffer with others.
pub use prost::bytes::Bytes;
pub use wire_error::{ERROR_CODE_METADATA_KEY, ERROR_REASON_METADATA_KEY, WireError};

/// The `levee.peer.v1` package: the internal protocol between the nodes of a cluster.
#[allow(missing_docs, clippy::pedantic, missing_debug_implementations)]
pub mod peer_v1 {
    tonic::include_proto!("levee.peer.v1");
}

/// The `levee.v1` protobuf package.
#[allow(missing_docs, clippy::pedantic, missing_debug_implementations)]
pub mod v1 {
    tonic::include_proto!("levee.v1");
}

/// Protobuf bytes around each key of a hot-key report, at most: the key's tag and length (up to
/// 3 bytes for keys up to 64 KiB), the count's tag and value (up to 5), the report's tag and
/// length (up to 4). A report message of N keys of at most K bytes takes at most
/// N x (K + this) + [`REPORT_BATCH_OVERHEAD_BYTES`] bytes.
pub const REPORT_KEY_OVERHEAD_BYTES: usize = 1 + 3 + 1 + 5 + 1 + 3;
/// Protobuf bytes around a whole hot-key report batch, at most: the message's oneof tag and
/// length.
pub const REPORT_BATCH_OVERHEAD_BYTES: usize = 1 + 5;

/// The partition of a topic with `partitions` partitions that `key` is published to:
/// `XXH3_64(key, seed 0) mod partitions`, over the key's bytes as given. Java
/// (`net.openhft:zero-allocation-hashing`, `LongHashFunction.xx3()`) and Python (`xxhash`,
/// `xxh3_64_intdigest`) compute the same value; the test below pins it.
///
/// # Panics
/// If `partitions` is 0 (a topic has at least one partition).
pub fn topic_partition(key: &[u8], partitions: u32) -> u32 {
    assert!(partitions > 0, "a topic has at least one partition");
    let partition = xxhash_rust::xxh3::xxh3_64(key) % u64::from(partitions);
    u32::try_from(partition).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_keys_then_partitions_match_the_published_xxh3_vectors() {
        // XXH3_64 of "" is 0x2d06800538d394c2 (the reference test vector); of "abc",
        // 0x78af5f94892f3950.
        assert_eq!(xxhash_rust::xxh3::xxh3_64(b""), 0x2d06_8005_38d3_94c2);
        assert_eq!(xxhash_rust::xxh3::xxh3_64(b"abc"), 0x78af_5f94_892f_3950);
        assert_eq!(
            topic_partition(b"", 64),
            (0x2d06_8005_38d3_94c2_u64 % 64) as u32
        );
        assert_eq!(
            topic_partition(b"abc", 10),
            (0x78af_5f94_892f_3950_u64 % 10) as u32
        );
        assert_eq!(topic_partition(b"anything", 1), 0);
    }
}
