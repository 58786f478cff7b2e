//! [`KeyBytes`]: a tracked key's bytes, kept inside the entry when short so that the hot path
//! compares keys without a second cache miss.

use std::ops::Deref;

/// Longest key kept inline.
pub const INLINE_KEY_BYTES: usize = 22;

/// A key: inline up to [`INLINE_KEY_BYTES`], on the heap beyond.
#[derive(Debug, Clone)]
pub enum KeyBytes {
    /// A short key, in place.
    Inline {
        /// Bytes used in `bytes`.
        length: u8,
        /// The key, then zeros.
        bytes: [u8; INLINE_KEY_BYTES],
    },
    /// A long key.
    Heap(Box<[u8]>),
}

impl KeyBytes {
    /// Bytes the key holds on the heap (0 when inline).
    pub fn heap_bytes(&self) -> usize {
        match self {
            KeyBytes::Inline { .. } => 0,
            KeyBytes::Heap(bytes) => bytes.len(),
        }
    }
}

impl From<&[u8]> for KeyBytes {
    fn from(key: &[u8]) -> Self {
        match u8::try_from(key.len()) {
            Ok(length) if key.len() <= INLINE_KEY_BYTES => {
                let mut bytes = [0; INLINE_KEY_BYTES];
                bytes[..key.len()].copy_from_slice(key);
                KeyBytes::Inline { length, bytes }
            }
            _ => KeyBytes::Heap(key.into()),
        }
    }
}

impl Deref for KeyBytes {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        match self {
            KeyBytes::Inline { length, bytes } => &bytes[..usize::from(*length)],
            KeyBytes::Heap(bytes) => bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_short_and_long_keys_when_stored_should_read_back_the_same_bytes() {
        for length in [1, 21, 22, 23, 200] {
            let key: Vec<u8> = (0..length)
                .map(|byte| u8::try_from(byte % 251).unwrap())
                .collect();
            let stored = KeyBytes::from(&key[..]);
            assert_eq!(&*stored, &key[..]);
            assert_eq!(
                stored.heap_bytes(),
                if length <= INLINE_KEY_BYTES {
                    0
                } else {
                    length
                }
            );
        }
        assert_eq!(std::mem::size_of::<KeyBytes>(), 24);
    }
}
