//! [`Sketch`]: the heavy-hitter prefilter, a Count-Min sketch with conservative update and two
//! generations, laid out so that one key touches one 64-byte cache line.
//!
//! Each key hashes to one block; the block holds 8 cells of the current generation and 8 of
//! the previous one. The key's 4 rows are cell `2 * row + bit` of the block (one bit of the hash
//! per row), so the rows never share a cell. The estimate is the least over the rows of
//! current plus previous cell: never below the key's true hits since the previous generation
//! began. A rotation (every `generation_ms`, lazily) moves the current generation to the
//! previous one and clears the current one, so the sketch remembers at least the last
//! `generation_ms` of hits and at most two generations.

/// Rows (cells per key per generation).
pub const SKETCH_ROWS: usize = 4;
/// Bytes of one block: one cache line.
pub const SKETCH_BLOCK_BYTES: usize = 64;

/// One cache line: 8 cells of the current generation, then 8 of the previous one.
#[derive(Debug, Clone, Copy, Default)]
#[repr(align(64))]
struct Block([u32; 16]);

const PREVIOUS_OFFSET: usize = 8;

/// The Count-Min sketch of an engine (all apps share it: the key's hash includes its app).
#[derive(Debug)]
pub struct Sketch {
    blocks: Vec<Block>,
    block_mask: u64,
    generation_ms: u64,
    generation_start_ms: u64,
}

impl Sketch {
    /// A sketch of at most `bytes` (a power of two number of blocks, at least one) that rotates
    /// every `generation_ms`.
    pub fn new(bytes: usize, generation_ms: u64) -> Self {
        let blocks_max = (bytes / SKETCH_BLOCK_BYTES).max(1);
        // The largest power of two not above blocks_max.
        let block_count = 1_usize << (usize::BITS - 1 - blocks_max.leading_zeros());
        Self {
            blocks: vec![Block::default(); block_count],
            block_mask: u64::try_from(block_count - 1).unwrap_or(u64::MAX),
            generation_ms: generation_ms.max(1),
            generation_start_ms: 0,
        }
    }

    /// Bytes the sketch holds.
    pub fn bytes(&self) -> usize {
        self.blocks.len() * SKETCH_BLOCK_BYTES
    }

    /// Sets the rotation period (the longest window the sketch must remember).
    pub fn set_generation_ms(&mut self, generation_ms: u64) {
        self.generation_ms = generation_ms.max(1);
    }

    /// Rotates if the current generation is `generation_ms` old at `now_ms`.
    #[inline]
    pub fn rotate_if_due(&mut self, now_ms: u64) {
        if now_ms >= self.generation_start_ms.saturating_add(self.generation_ms) {
            for block in &mut self.blocks {
                let (current, previous) = block.0.split_at_mut(PREVIOUS_OFFSET);
                previous.copy_from_slice(current);
                current.fill(0);
            }
            self.generation_start_ms = now_ms;
        }
    }

    /// Adds `count` hits of the key with hash `hash` (conservative update) and returns the
    /// estimate before adding them.
    #[inline]
    pub fn add(&mut self, hash: u64, count: u32) -> u64 {
        let (block_index, cells) = self.locate(hash);
        let block = &mut self.blocks[block_index].0;
        let mut current_min = u32::MAX;
        let mut estimate = u64::MAX;
        for cell in cells {
            current_min = current_min.min(block[cell]);
            estimate =
                estimate.min(u64::from(block[cell]) + u64::from(block[cell + PREVIOUS_OFFSET]));
        }
        let target = current_min.saturating_add(count);
        for cell in cells {
            block[cell] = block[cell].max(target);
        }
        estimate
    }

    /// Loads the key's block and returns one of its cells, so that a later [`Sketch::add`] finds
    /// it in cache. Callers pass the result to `std::hint::black_box` so that the load stays.
    #[inline]
    pub fn touch(&self, hash: u64) -> u32 {
        let (block_index, _) = self.locate(hash);
        self.blocks[block_index].0[0]
    }

    /// The key's estimate, without adding to it.
    pub fn estimate(&self, hash: u64) -> u64 {
        let (block_index, cells) = self.locate(hash);
        let block = &self.blocks[block_index].0;
        cells
            .iter()
            .map(|&cell| u64::from(block[cell]) + u64::from(block[cell + PREVIOUS_OFFSET]))
            .min()
            .unwrap_or(0)
    }

    #[inline]
    fn locate(&self, hash: u64) -> (usize, [usize; SKETCH_ROWS]) {
        let mixed = (hash ^ (hash >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mixed = mixed ^ (mixed >> 32);
        // The mask keeps the index below the block count, which is a usize.
        let block_index = usize::try_from(mixed & self.block_mask).unwrap_or_default();
        let bits = mixed >> 60;
        let mut cells = [0; SKETCH_ROWS];
        for (row, cell) in cells.iter_mut().enumerate() {
            *cell = 2 * row + usize::from((bits >> row) & 1 == 1);
        }
        (block_index, cells)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_bytes_when_created_should_round_down_to_power_of_two_blocks() {
        assert_eq!(Sketch::new(0, 1_000).bytes(), 64);
        assert_eq!(Sketch::new(64 * 5, 1_000).bytes(), 64 * 4);
        assert_eq!(Sketch::new(1 << 20, 1_000).bytes(), 1 << 20);
    }

    #[test]
    fn given_many_keys_in_one_block_when_added_should_never_underestimate() {
        // One block: every key collides, which is the worst case for accuracy.
        let mut sketch = Sketch::new(64, 1_000_000);
        let mut true_counts = vec![0_u64; 50];
        for step in 0..5_000_u64 {
            let key = (step * 7919) % 50;
            let hash = key.wrapping_mul(0x2545_F491_4F6C_DD1D);
            let count = u32::try_from(step % 3 + 1).unwrap();
            let before = sketch.add(hash, count);
            let index = usize::try_from(key).unwrap();
            assert!(before >= true_counts[index]);
            true_counts[index] += u64::from(count);
            assert!(sketch.estimate(hash) >= true_counts[index]);
        }
    }

    #[test]
    fn given_rotation_when_two_generations_pass_should_forget_old_hits() {
        let mut sketch = Sketch::new(1 << 12, 1_000);
        sketch.rotate_if_due(0);
        assert_eq!(sketch.add(42, 5), 0);
        sketch.rotate_if_due(999);
        assert_eq!(sketch.estimate(42), 5);
        sketch.rotate_if_due(1_000);
        assert_eq!(
            sketch.estimate(42),
            5,
            "the previous generation still holds it"
        );
        sketch.rotate_if_due(2_000);
        assert_eq!(sketch.estimate(42), 0);
    }
}
