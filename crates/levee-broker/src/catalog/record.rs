//! [`CatalogRecord`]: one change of the catalog as it is logged (today a JSON record of the
//! server's `\0meta` queue; the layout is in docs/FORMAT.md), with its encoding.

use serde::{Deserialize, Serialize};

use super::CatalogError;

/// One logged change of the catalog. Applying every record in log order rebuilds the catalog.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CatalogRecord {
    /// A topic was created.
    Topic {
        /// Its name.
        topic: String,
        /// Its partition count, fixed for its life.
        partitions: u32,
    },
    /// A group's delivery rate was set (0: no limit).
    GroupRate {
        /// The group.
        group: String,
        /// Messages per second.
        messages_per_s: f64,
    },
    /// A producer name's append rate was set (0: no limit).
    ProducerRate {
        /// The producer name.
        producer_name: String,
        /// Messages per second.
        messages_per_s: f64,
    },
    /// A group's retry policy was set (`None`: back to the default).
    RetryPolicy {
        /// The group.
        group: String,
        /// The policy.
        policy: Option<crate::retry::RetryPolicy>,
    },
    /// A retention rule was set (both bounds 0: removed).
    Retention {
        /// The queue-name prefix, as lowercase hex.
        prefix_hex: String,
        /// Remove messages older than this (0: no bound).
        max_age_ms: u64,
        /// Remove the oldest messages while the queue holds more bytes (0: no bound).
        max_bytes: u64,
    },
}

impl CatalogRecord {
    /// The record's bytes in the log.
    pub fn encode(&self) -> Vec<u8> {
        // Serialising these plain fields cannot fail (no maps with non-string keys, no
        // failing Serialize impls); the fallback is never taken.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The record logged at `offset` from its bytes.
    pub fn decode(bytes: &[u8], offset: u64) -> Result<Self, CatalogError> {
        serde_json::from_slice(bytes).map_err(|error| CatalogError::Unreadable {
            offset,
            reason: error.to_string(),
        })
    }
}

/// `bytes` as lowercase hex.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut text, byte| {
        let _ = write!(text, "{byte:02x}");
        text
    })
}

/// Hex text as bytes, `None` if it is not hex.
pub(crate) fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_records_then_the_logged_json_is_the_documented_layout() {
        let record = CatalogRecord::Topic {
            topic: "orders".to_owned(),
            partitions: 8,
        };
        assert_eq!(
            record.encode(),
            br#"{"kind":"topic","topic":"orders","partitions":8}"#.to_vec()
        );
        let retention = CatalogRecord::Retention {
            prefix_hex: to_hex(b"driver-"),
            max_age_ms: 5,
            max_bytes: 0,
        };
        assert_eq!(
            CatalogRecord::decode(&retention.encode(), 0).unwrap(),
            retention
        );
        assert_eq!(from_hex("6472"), Some(b"dr".to_vec()));
        assert_eq!(from_hex("6"), None);
        assert_eq!(from_hex("zz"), None);
        assert!(matches!(
            CatalogRecord::decode(b"{}", 7),
            Err(CatalogError::Unreadable { offset: 7, .. })
        ));
    }
}
