//! Producers: what the server remembers of each idempotent producer so that a resent append
//! stores nothing twice (`idempotent`). Producer names' rate limits are in `limits`.

pub mod idempotent;
