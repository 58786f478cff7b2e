//! The result of [`crate::Store::read`]: messages copied into one buffer.

/// Messages read from one queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// Offset of the first message returned (or where reading would start).
    pub first_offset: u64,
    /// The requested offset was before the first retained one, so reading started there.
    pub skipped_to_first_retained: bool,
    /// End of what a read could see when it ran: under `always` the end of the fsynced
    /// messages, under `interval` the queue's next offset (acknowledged, maybe not yet
    /// fsynced).
    pub visible_end_offset: u64,
    data: Vec<u8>,
    ends: Vec<usize>,
}

impl ReadBatch {
    pub(crate) fn new(first_offset: u64, skipped: bool, visible_end_offset: u64) -> Self {
        Self {
            first_offset,
            skipped_to_first_retained: skipped,
            visible_end_offset,
            data: Vec::new(),
            ends: Vec::new(),
        }
    }

    pub(crate) fn reserve(&mut self, messages: usize, bytes: usize) {
        self.ends.reserve(messages);
        self.data.reserve(bytes);
    }

    pub(crate) fn push(&mut self, message: &[u8]) {
        self.data.extend_from_slice(message);
        self.ends.push(self.data.len());
    }

    /// Bytes of all messages.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// No message was returned.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Offset after the last message returned: where the next read continues.
    pub fn next_offset(&self) -> u64 {
        self.first_offset + self.ends.len() as u64
    }

    /// Message `index` (0 is the message at `first_offset`).
    pub fn message(&self, index: usize) -> Option<&[u8]> {
        let end = *self.ends.get(index)?;
        let start = if index == 0 { 0 } else { self.ends[index - 1] };
        Some(&self.data[start..end])
    }

    /// The messages' bytes back to back and the end of each message in them, for a caller
    /// that hands out the messages without copying them again.
    pub fn into_parts(self) -> (Vec<u8>, Vec<usize>) {
        (self.data, self.ends)
    }

    /// The messages in offset order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.ends.len()).filter_map(|index| self.message(index))
    }
}
