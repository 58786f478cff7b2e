//! The engine's configuration: its bounds (memory budget, key length, apps, sketch size,
//! admission divisor, reclaim pace, hash seed) in [`EngineConfig`] with their defaults, and
//! what a report for an unknown app does ([`UnknownAppPolicy`]).

/// Default [`EngineConfig::admission_divisor`].
pub const ADMISSION_DIVISOR_DEFAULT: u64 = 8;

/// What the engine does with a report for an app it has not seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownAppPolicy {
    /// Create the app with the default rule (`*`: 1000 hits in 5 s, hot for 60 s).
    Create,
    /// Refuse the report with [`ReportError::UnknownApp`](super::ReportError::UnknownApp).
    Refuse,
}

/// The engine's bounds.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most bytes the engine's state may use, all apps together.
    pub memory_budget_bytes: usize,
    /// Longest key accepted, in bytes.
    pub key_bytes_max: usize,
    /// Most apps.
    pub apps_max: usize,
    /// What a report for an unknown app does.
    pub unknown_app: UnknownAppPolicy,
    /// Bytes of the Count-Min prefilter shared by all apps (rounded down to a power of two of
    /// 64-byte blocks, and to at most half of `memory_budget_bytes`). More bytes: fewer cold keys
    /// admitted to exact windows under many distinct keys.
    pub sketch_bytes: usize,
    /// A key gets an exact window once its sketch estimate reaches
    /// `max(1, threshold / admission_divisor)` (its rule's admission). Larger: fewer keys tracked,
    /// looser precision bound (see the crate docs).
    pub admission_divisor: u64,
    /// Most tracked keys per app that one [`HotKeyEngine::tick`](super::HotKeyEngine::tick)
    /// inspects to reclaim idle ones (it resumes where it stopped on the next tick).
    pub reclaim_keys_per_tick: usize,
    /// Seed of the key hash (sketch cells and tables). `None`: a random seed per engine, so that
    /// clients cannot choose keys that collide. `Some`: the same seed gives the same sketch
    /// collisions, for reproducible tests and simulations.
    pub hash_seed: Option<u64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            memory_budget_bytes: 256 * 1024 * 1024,
            key_bytes_max: 1_024,
            apps_max: 10_000,
            unknown_app: UnknownAppPolicy::Create,
            sketch_bytes: 32 * 1024 * 1024,
            admission_divisor: ADMISSION_DIVISOR_DEFAULT,
            reclaim_keys_per_tick: 4_096,
            hash_seed: None,
        }
    }
}
