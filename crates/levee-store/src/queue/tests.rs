//! Tests of the per-queue state: the sparse chunk index against a deque (proptest) and its
//! size and slack, spare write buffers, and a small buffer's position list.

use proptest::prelude::*;

use super::*;

/// The byte position of the message at `offset`, walked from the start.
fn walked(buffer: &WriteBuffer, offset: u64) -> usize {
    let mut position = 0;
    let steps = offset.clamp(buffer.first_offset, buffer.end_offset()) - buffer.first_offset;
    for _ in 0..steps {
        position = buffer.message_at(position).1;
    }
    position
}

#[derive(Debug, Clone)]
enum Step {
    Push(usize),
    Drain(usize),
    Truncate(usize),
    Reset(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (0_usize..40).prop_map(Step::Push),
        1 => (0_usize..200).prop_map(Step::Drain),
        1 => (0_usize..200).prop_map(Step::Truncate),
        1 => (0_u64..1000).prop_map(Step::Reset),
    ]
}

#[derive(Debug, Clone)]
enum IndexStep {
    /// Offset delta, segment step (0 same, 1 next, else any), position.
    Push(u64, u8, u32),
    Pop(usize),
    /// Which entry (modulo the length), new segment and position.
    Relocate(usize, u32, u32),
}

fn index_step() -> impl Strategy<Value = IndexStep> {
    prop_oneof![
        8 => (1_u64..2000, 0_u8..4, any::<u32>()).prop_map(|(delta, step, position)| {
            IndexStep::Push(delta, step, position)
        }),
        1 => (0_usize..40).prop_map(IndexStep::Pop),
        1 => (any::<usize>(), 0_u32..5, any::<u32>())
            .prop_map(|(index, segment, position)| IndexStep::Relocate(index, segment, position)),
    ]
}

proptest! {
    #[test]
    fn given_pushes_pops_and_relocations_when_reading_the_index_should_match_a_deque(
        first_offset in 0_u64..(1 << 40),
        steps in prop::collection::vec(index_step(), 1..300),
    ) {
        let mut index = ChunkIndex::default();
        let mut model: VecDeque<ChunkEntry> = VecDeque::new();
        let mut next_offset = first_offset;
        let mut segment = 1_u32;
        for step in steps {
            match step {
                IndexStep::Push(delta, step, position) => {
                    segment = match step {
                        0 => segment,
                        1 => segment + 1,
                        _ => position % 1000,
                    };
                    let entry = ChunkEntry { first_offset: next_offset, segment, position };
                    next_offset += delta;
                    index.push_back(entry);
                    model.push_back(entry);
                }
                IndexStep::Pop(count) => {
                    for _ in 0..count {
                        prop_assert_eq!(index.pop_front(), model.pop_front());
                    }
                }
                IndexStep::Relocate(at, new_segment, position) => {
                    if !model.is_empty() {
                        let at = at % model.len();
                        let entry = ChunkEntry { segment: new_segment, position, ..model[at] };
                        index.set(at, entry);
                        model[at] = entry;
                    }
                }
            }
            prop_assert_eq!(index.len(), model.len());
            prop_assert_eq!(index.front(), model.front().copied());
            prop_assert_eq!(index.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
            let probes = model.iter().flat_map(|entry| {
                [entry.first_offset.saturating_sub(1), entry.first_offset, entry.first_offset + 1]
            });
            for offset in probes.chain([0, u64::MAX]) {
                let expected = model.partition_point(|entry| entry.first_offset <= offset);
                prop_assert_eq!(index.partition_point(|entry| entry.first_offset <= offset), expected);
                let found = model.iter().position(|entry| entry.first_offset == offset);
                prop_assert_eq!(index.find(offset), found.map(|at| (at, model[at])));
                prop_assert_eq!(
                    index.iter_from(expected.saturating_sub(1)).collect::<Vec<_>>(),
                    model.range(expected.saturating_sub(1)..).copied().collect::<Vec<_>>()
                );
            }
        }
    }
}

/// The entries of one queue among many: `chunks` chunks of `per_chunk` messages, each
/// `distance` bytes after the one before, in 256 MiB segments whose ids step by
/// `segment_step` when a chunk passes the end.
fn spread(chunks: u64, per_chunk: u64, distance: u32, segment_step: u32) -> Vec<ChunkEntry> {
    let (mut segment, mut position) = (1_u32, 1_000_u32);
    (0..chunks)
        .map(|chunk| {
            let entry = ChunkEntry {
                first_offset: chunk * per_chunk,
                segment,
                position,
            };
            position += distance;
            if position > 256 << 20 {
                segment += segment_step;
                position -= 256 << 20;
            }
            entry
        })
        .collect()
}

#[test]
fn given_a_queue_among_a_million_when_indexing_should_take_about_five_bytes_per_chunk() {
    // At a million queues a queue's consecutive chunks are a budget flush apart: about
    // four messages each, in the next segment or 100-200 MB further in the same one.
    let mut index = ChunkIndex::default();
    for entry in spread(1000, 4, 190 << 20, 1) {
        index.push_back(entry);
    }
    index.shrink_to_fit();
    let bytes = index.heap_bytes();
    assert!(bytes <= 5_500, "{bytes} bytes for 1,000 chunks");
    assert_eq!(index.find(400).map(|(at, _)| at), Some(100));
}

#[test]
fn given_a_kept_buffer_when_taken_again_should_start_fresh_with_its_allocation() {
    let mut spares = SpareBuffers::default();
    let mut buffer = spares.take(7);
    for index in 0..40_u8 {
        buffer.push_toward_chunk(&[index; 50], 256);
    }
    buffer.mark(3, 47, 1);
    buffer.frozen = 40;
    buffer.frozen_bytes = buffer.budget_bytes();
    buffer.drain_front(40, buffer.frozen_bytes);
    let capacity = buffer.data.capacity();
    let memory = std::mem::size_of::<WriteBuffer>() + capacity;
    spares.keep(buffer, memory - 1);
    assert_eq!(spares.len(), 0, "over the bound: dropped");
    let mut buffer = spares.take(47);
    buffer.push_toward_chunk(&[1; 50], 256);
    buffer.frozen = 1;
    buffer.frozen_bytes = buffer.budget_bytes();
    buffer.drain_front(1, buffer.frozen_bytes);
    let capacity = buffer.data.capacity();
    let memory = std::mem::size_of::<WriteBuffer>() + capacity;
    spares.keep(buffer, memory);
    assert_eq!((spares.len(), spares.bytes()), (1, memory));
    let buffer = spares.take(48);
    assert_eq!((spares.len(), spares.bytes()), (0, 0));
    assert_eq!(buffer.data.capacity(), capacity, "the allocation is reused");
    let fresh = WriteBuffer {
        first_offset: 48,
        logged_end: 48,
        ..WriteBuffer::default()
    };
    assert_eq!(
        format!("{buffer:?}"),
        format!("{fresh:?}"),
        "nothing else kept"
    );
}

#[test]
fn given_a_buffer_of_a_few_messages_when_reading_should_need_no_position_list() {
    // A mailbox's buffer holds a message or two: its first message, even at a multiple of
    // the stride, is at position 0 and is not remembered.
    let mut buffer = WriteBuffer {
        first_offset: 32,
        ..WriteBuffer::default()
    };
    buffer.push_toward_chunk(b"first", 4096);
    buffer.push_toward_chunk(b"second", 4096);
    assert_eq!(buffer.positions.capacity(), 0);
    assert_eq!(buffer.position_of(33), FRAME_BYTES + 5);
    for _ in 2..20 {
        buffer.push_toward_chunk(b"more", 4096);
    }
    assert_eq!(buffer.positions.len(), 1, "offset 48 is remembered");
}

#[test]
fn given_an_index_growing_when_pushing_should_keep_its_slack_to_an_eighth() {
    // A million indexes that are growing (under load, none shrunk yet) must not carry the
    // slack of doubling vectors: that was 2.35 instead of 1.42 bytes per message.
    let mut index = ChunkIndex::default();
    for (chunk, entry) in spread(500, 6, 70 << 20, 2).into_iter().enumerate() {
        index.push_back(entry);
        let (used, capacity) = (index.bytes.len(), index.bytes.capacity());
        assert!(
            capacity <= used + used / 8 + 20,
            "{capacity} bytes held for {used} after {chunk} pushes"
        );
    }
    assert_eq!(index.len(), 500);
    assert_eq!(index.find(6 * 321).map(|(at, _)| at), Some(321));
}

proptest! {
    #[test]
    fn given_pushes_drains_and_truncations_when_locating_should_match_a_walk(
        first_offset in 0_u64..300,
        steps in prop::collection::vec(step(), 1..400),
    ) {
        let mut buffer = WriteBuffer { first_offset, ..WriteBuffer::default() };
        // The messages buffered, as a plain model: each message's bytes name its offset.
        let mut model: VecDeque<Vec<u8>> = VecDeque::new();
        for step in steps {
            match step {
                Step::Push(length) => {
                    let message: Vec<u8> = (0..length as u64)
                        .map(|index| (buffer.end_offset().wrapping_add(index)).to_le_bytes()[0])
                        .collect();
                    buffer.push_toward_chunk(&message, 100);
                    model.push_back(message);
                }
                Step::Drain(count) => {
                    let count = count.min(buffer.count);
                    let bytes = walked(&buffer, buffer.first_offset + count as u64);
                    buffer.frozen = count;
                    buffer.frozen_bytes = bytes;
                    buffer.drain_front(count, bytes);
                    model.drain(..count);
                }
                Step::Truncate(keep) => {
                    buffer.truncate_to(buffer.first_offset + keep as u64);
                    model.truncate(keep);
                }
                Step::Reset(offset) => {
                    buffer.reset(offset);
                    model.clear();
                }
            }
            for offset in buffer.first_offset.saturating_sub(2)..buffer.end_offset() + 2 {
                prop_assert_eq!(buffer.position_of(offset), walked(&buffer, offset));
            }
            let mut position = 0;
            for message in &model {
                let (read, next) = buffer.message_at(position);
                prop_assert_eq!(read, message.as_slice());
                position = next;
            }
            prop_assert_eq!(position, buffer.budget_bytes());
            prop_assert_eq!(buffer.count, model.len());
        }
    }
}
