//! Opens an existing store and prints its recovery report (for profiling recovery):
//! `cargo run -p levee-store --release --example reopen -- DIR`.

use levee_store::{Store, StoreOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let directory = std::env::args().nth(1).ok_or("usage: reopen DIR")?;
    let (store, report) = Store::open(&directory, StoreOptions::default())?;
    println!("{report:?}");
    drop(store);
    Ok(())
}
