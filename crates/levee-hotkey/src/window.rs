//! [`Window`]: one key's sliding-window counter, a ring of time slots with a running total.
//!
//! A rule's window of `window_ms` is cut into slots of `slot_ms` (see [`slot_ms`]), aligned to
//! multiples of `slot_ms` in engine time. The count at `now` is the sum of the slots that
//! overlap `(now - window_ms, now]`: never less than the hits in that interval, never more
//! than the hits in `(now - window_ms - slot_ms, now]`. Old slots are dropped lazily when time
//! moves on, so an update is O(1) amortised.

/// Slots a window is cut into (before rounding `slot_ms` down).
pub const WINDOW_SLOTS: u64 = 10;
/// Shortest slot.
pub const SLOT_MS_MIN: u64 = 10;
/// Slots held in the ring: enough for every slot that can overlap a window (at most 12 for a
/// window of 100 ms or more with `slot_ms = window_ms / 10`).
const RING_SLOTS: usize = 12;
/// [`RING_SLOTS`] as a `u64` (a constant, so no lossy cast at run time).
const RING_SLOTS_U64: u64 = 12;

/// The slot length of a window.
pub fn slot_ms(window_ms: u64) -> u64 {
    (window_ms / WINDOW_SLOTS).max(SLOT_MS_MIN)
}

/// The index of the oldest slot that overlaps `(now - window_ms, now]`.
fn oldest_live_slot(now_ms: u64, window_ms: u64, slot_ms: u64) -> u64 {
    (now_ms + 1).saturating_sub(window_ms) / slot_ms
}

/// A sliding-window counter. Its rule's `window_ms` and `slot_ms` are passed to each call (the
/// engine keeps them once per rule, not once per key).
/// C order: the fields every update reads come first, next to the entry's key.
#[derive(Debug, Clone)]
#[repr(C)]
pub struct Window {
    /// Before this time neither end of the window moves: an update only adds to the newest slot.
    next_change_ms: u64,
    /// Sum of the slots from `oldest_slot` to `newest_slot`.
    total: u64,
    /// Index (time / `slot_ms`) of the oldest slot in `total`.
    oldest_slot: u64,
    /// Index of the newest slot written.
    newest_slot: u64,
    slots: [u64; RING_SLOTS],
}

impl Window {
    /// A window whose newest slot (the one holding `now_ms`) starts at `count`.
    pub fn new(count: u64, now_ms: u64, window_ms: u64, slot_ms: u64) -> Self {
        debug_assert!(
            Self::fits(window_ms, slot_ms),
            "ring too small for {window_ms}/{slot_ms}"
        );
        let newest_slot = now_ms / slot_ms;
        let mut window = Self {
            slots: [0; RING_SLOTS],
            total: 0,
            oldest_slot: newest_slot,
            newest_slot,
            next_change_ms: 0,
        };
        window.advance(now_ms, window_ms, slot_ms);
        window.add_to_newest(count);
        window
    }

    /// Whether every slot overlapping a window fits in the ring.
    pub fn fits(window_ms: u64, slot_ms: u64) -> bool {
        window_ms.div_ceil(slot_ms) < RING_SLOTS_U64
    }

    /// Adds `count` hits at `now_ms` and returns the count in the window now. `now_ms` earlier
    /// than a previous call is treated as that call's time.
    #[inline]
    pub fn add(&mut self, count: u64, now_ms: u64, window_ms: u64, slot_ms: u64) -> u64 {
        if now_ms >= self.next_change_ms {
            self.advance(now_ms, window_ms, slot_ms);
        }
        self.add_to_newest(count)
    }

    /// The count in the window at `now_ms`, after dropping the slots that left it.
    pub fn count_advanced(&mut self, now_ms: u64, window_ms: u64, slot_ms: u64) -> u64 {
        if now_ms >= self.next_change_ms {
            self.advance(now_ms, window_ms, slot_ms);
        }
        self.total
    }

    /// The count in the window at `now_ms`, without changing the window.
    pub fn count_at(&self, now_ms: u64, window_ms: u64, slot_ms: u64) -> u64 {
        let oldest = oldest_live_slot(now_ms, window_ms, slot_ms).max(self.oldest_slot);
        if oldest == self.oldest_slot {
            return self.total;
        }
        (oldest..=self.newest_slot)
            .map(|slot| self.slots[ring_position(slot)])
            .fold(0, u64::saturating_add)
    }

    /// Reads the newest slot, so that a following [`Window::add`] finds it in cache. Callers pass
    /// the result to `std::hint::black_box` so that the load stays.
    #[inline]
    pub fn touch(&self) -> u64 {
        self.slots[ring_position(self.newest_slot)]
    }

    fn add_to_newest(&mut self, count: u64) -> u64 {
        let position = ring_position(self.newest_slot);
        self.slots[position] = self.slots[position].saturating_add(count);
        self.total = self.total.saturating_add(count);
        self.total
    }

    /// Moves the window's ends to `now_ms`: drops slots older than the window and makes the
    /// slot holding `now_ms` the newest.
    fn advance(&mut self, now_ms: u64, window_ms: u64, slot_ms: u64) {
        let now_slot = now_ms / slot_ms;
        let oldest = oldest_live_slot(now_ms, window_ms, slot_ms);
        if oldest > self.oldest_slot {
            // Non-zero slots lie in oldest_slot..=newest_slot, fewer than RING_SLOTS of them.
            let end = oldest.min(self.newest_slot + 1);
            for slot in self.oldest_slot..end {
                let position = ring_position(slot);
                self.total = self.total.saturating_sub(self.slots[position]);
                self.slots[position] = 0;
            }
            self.oldest_slot = oldest;
        }
        if now_slot > self.newest_slot {
            // The ring positions of the new slots held slots older than `oldest`: already zero.
            self.newest_slot = now_slot;
        }
        if self.oldest_slot > self.newest_slot {
            self.oldest_slot = self.newest_slot;
        }
        // The newest slot ends at (newest + 1) * slot_ms; the oldest slot leaves the window
        // when now + 1 - window_ms reaches (oldest + 1) * slot_ms.
        let newest_end_ms = (self.newest_slot + 1) * slot_ms;
        let oldest_leaves_ms = ((self.oldest_slot + 1) * slot_ms + window_ms).saturating_sub(1);
        self.next_change_ms = newest_end_ms.min(oldest_leaves_ms);
    }
}

fn ring_position(slot: u64) -> usize {
    // The remainder is below RING_SLOTS, so it fits in usize.
    usize::try_from(slot % RING_SLOTS_U64).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW_MS: u64 = 1_000;
    const SLOT_MS: u64 = 100;

    #[test]
    fn given_every_valid_window_when_sliced_should_fit_the_ring() {
        for window_ms in 100..=600_000 {
            assert!(Window::fits(window_ms, slot_ms(window_ms)), "{window_ms}");
        }
    }

    #[test]
    fn given_hit_at_t_when_time_passes_should_count_until_window_and_drop_by_window_plus_slot() {
        for t in [0, 1, 99, 100, 12_345, 1_000_000] {
            let mut window = Window::new(1, t, WINDOW_MS, SLOT_MS);
            assert_eq!(
                window.count_at(t + WINDOW_MS - 1, WINDOW_MS, SLOT_MS),
                1,
                "t={t}"
            );
            assert_eq!(
                window.count_advanced(t + WINDOW_MS - 1, WINDOW_MS, SLOT_MS),
                1,
                "t={t}"
            );
            assert_eq!(
                window.count_at(t + WINDOW_MS + SLOT_MS, WINDOW_MS, SLOT_MS),
                0,
                "t={t}"
            );
            assert_eq!(
                window.count_advanced(t + WINDOW_MS + SLOT_MS, WINDOW_MS, SLOT_MS),
                0
            );
        }
    }

    #[test]
    fn given_hit_at_slot_start_when_its_slot_leaves_the_window_should_drop_exactly_then() {
        // A hit at 1000 is in (now - 1000, now] until now = 1999; its slot (1000..=1099)
        // overlaps that interval until now = 2098.
        let mut window = Window::new(1, 1_000, WINDOW_MS, SLOT_MS);
        assert_eq!(window.count_advanced(1_999, WINDOW_MS, SLOT_MS), 1);
        assert_eq!(window.count_advanced(2_098, WINDOW_MS, SLOT_MS), 1);
        assert_eq!(window.count_advanced(2_099, WINDOW_MS, SLOT_MS), 0);
    }

    #[test]
    fn given_hits_across_slots_when_counted_should_match_slot_overlap_sum() {
        let mut window = Window::new(0, 0, WINDOW_MS, SLOT_MS);
        let mut hits = Vec::new();
        let mut now = 0;
        for step in 0..500_u64 {
            now += step % 37;
            let count = step % 5 + 1;
            hits.push((now, count));
            let total = window.add(count, now, WINDOW_MS, SLOT_MS);
            let oldest = oldest_live_slot(now, WINDOW_MS, SLOT_MS);
            let expected: u64 = hits
                .iter()
                .filter(|(time, _)| time / SLOT_MS >= oldest)
                .map(|(_, count)| count)
                .sum();
            assert_eq!(total, expected, "step {step} now {now}");
            assert_eq!(window.count_at(now, WINDOW_MS, SLOT_MS), expected);
            let exact: u64 = hits
                .iter()
                .filter(|(time, _)| time + WINDOW_MS > now)
                .map(|(_, count)| count)
                .sum();
            let loose: u64 = hits
                .iter()
                .filter(|(time, _)| time + WINDOW_MS + SLOT_MS > now)
                .map(|(_, count)| count)
                .sum();
            assert!(
                exact <= total && total <= loose,
                "{exact} <= {total} <= {loose}"
            );
        }
    }

    #[test]
    fn given_time_going_backwards_when_added_should_count_in_newest_slot() {
        let mut window = Window::new(1, 5_000, WINDOW_MS, SLOT_MS);
        assert_eq!(window.add(1, 4_000, WINDOW_MS, SLOT_MS), 2);
        assert_eq!(window.count_advanced(5_999, WINDOW_MS, SLOT_MS), 2);
        assert_eq!(window.count_advanced(6_100, WINDOW_MS, SLOT_MS), 0);
    }
}
