//! Opens an existing store and prints its recovery report (for profiling recovery):
//! `cargo run -p levee-store --release --example reopen -- DIR`; then prints the memory the
//! store holds.

#![allow(clippy::cast_precision_loss, reason = "ratios for a report")]

use levee_store::{Store, StoreOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let directory = std::env::args().nth(1).ok_or("usage: reopen DIR")?;
    let (store, report) = Store::open(&directory, StoreOptions::default())?;
    println!("{report:?}");
    let usage = store.memory_usage();
    println!(
        "{usage:?}: index per message {:.3} B, memory per queue {:.0} B",
        usage.index_bytes as f64 / report.messages.max(1) as f64,
        usage.total_bytes as f64 / usage.queues.max(1) as f64
    );
    drop(store);
    Ok(())
}
