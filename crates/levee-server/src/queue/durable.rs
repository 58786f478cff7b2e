//! [`DurabilityWaiter`]: turns the store's blocking `wait_durable(ticket)` into an async wait
//! without a blocking-pool thread per request. Requests register a oneshot under their commit
//! ticket; one thread waits for the lowest registered ticket's round and answers every request
//! of that ticket at once (group commit, end to end). Rounds complete in order, so the thread
//! mostly finds the next tickets already durable.
//!
//! The thread holds only a weak reference to the store, so it never keeps the store from being
//! closed, and it stops when the waiter is dropped.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, Weak};

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use levee_store::{CommitTicket, Store};
use tokio::sync::oneshot;

use crate::queue::{lock, write_error};

type Answer = oneshot::Sender<Result<(), WireError>>;

#[derive(Debug, Default)]
struct Pending {
    tickets: BTreeMap<CommitTicket, Vec<Answer>>,
    closed: bool,
}

#[derive(Debug, Default)]
struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
}

/// See the module docs.
#[derive(Debug)]
pub struct DurabilityWaiter {
    shared: Arc<Shared>,
}

impl DurabilityWaiter {
    /// Starts the waiting thread for `store`.
    pub fn start(store: &Arc<Store>) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let (thread_shared, store) = (Arc::clone(&shared), Arc::downgrade(store));
        std::thread::Builder::new()
            .name("levee-durable".to_owned())
            .spawn(move || run(&thread_shared, &store))?;
        Ok(Self { shared })
    }

    /// Returns once the appends behind `ticket` are fsynced, or with the round's error.
    pub async fn wait(&self, ticket: CommitTicket) -> Result<(), WireError> {
        let (answer, answered) = oneshot::channel();
        {
            let mut pending = lock(&self.shared.pending);
            if pending.closed {
                return Err(closed());
            }
            pending.tickets.entry(ticket).or_default().push(answer);
        }
        self.shared.wake.notify_one();
        answered.await.unwrap_or_else(|_| Err(closed()))
    }
}

impl Drop for DurabilityWaiter {
    fn drop(&mut self) {
        lock(&self.shared.pending).closed = true;
        self.shared.wake.notify_one();
    }
}

fn closed() -> WireError {
    WireError::new(ErrorCode::Unavailable, "server shutting down")
}

fn run(shared: &Shared, store: &Weak<Store>) {
    loop {
        let (ticket, answers) = {
            let mut pending = lock(&shared.pending);
            loop {
                if pending.closed {
                    // Requests still waiting are answered by their dropped senders.
                    return;
                }
                if let Some(first) = pending.tickets.pop_first() {
                    break first;
                }
                pending = shared
                    .wake
                    .wait(pending)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let result = match store.upgrade() {
            Some(store) => store.wait_durable(ticket).map_err(write_error),
            None => Err(closed()),
        };
        for answer in answers {
            let _ = answer.send(result.clone());
        }
    }
}
