//! The hot-key engines' clock: milliseconds since the server started, monotonic, plus the wall
//! clock at start for the `hot_until_unix_ms` shown to people.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Engine time for one server process.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
    start_unix_ms: u64,
}

impl Clock {
    /// A clock whose zero is now.
    pub fn new() -> Self {
        let start_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
            });
        Self {
            start: Instant::now(),
            start_unix_ms,
        }
    }

    /// Milliseconds since the clock started.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Engine time as Unix milliseconds.
    pub fn to_unix_ms(self, engine_ms: u64) -> u64 {
        self.start_unix_ms.saturating_add(engine_ms)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
