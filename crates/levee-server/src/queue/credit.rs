//! [`StreamCredit`]: flow control of every delivery stream (subscriptions, many-queue mailbox
//! streams, topic consumers): the server sends only within the messages and payload bytes the
//! client granted, so a slow consumer costs bounded server memory; and the other bounds every
//! delivery stream shares.

use levee_proto::WireError;
use levee_proto::v1::{Credit, ErrorCode};

use crate::config::QUEUE_MESSAGE_BYTES_MAX_MAX;
use crate::server::GRPC_MESSAGE_BYTES_MAX;

/// Most payload bytes one delivery response carries (a message may pass it alone; messages are
/// at most 4 MiB), well under the 16 MiB gRPC message limit whatever the byte credit.
pub const ROUND_BYTES_MAX: u32 = 4 << 20;
/// Most messages one delivery round reads from the store and one response carries.
pub const ROUND_MESSAGES_MAX: u32 = 1_000;
/// How long a new stream (subscription, many-queue stream, consume stream) may take to send
/// its start message.
pub const STREAM_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Responses queued for one subscription's stream.
pub const RESPONSES_QUEUED_MAX: usize = 16;
/// Subscriptions open at once on one server.
pub const SUBSCRIPTIONS_MAX: usize = 100_000;
/// Most messages of credit a subscription may hold.
pub const CREDIT_MESSAGES_MAX: u32 = 100_000;
/// Most payload bytes of credit a subscription may hold.
pub const CREDIT_BYTES_MAX: u32 = 64 << 20;
/// Byte credit of a start that does not say.
pub const CREDIT_BYTES_DEFAULT: u32 = 4 << 20;

const _: () = assert!(
    CREDIT_BYTES_DEFAULT <= CREDIT_BYTES_MAX,
    "the default credit is within its bound"
);
const _: () = assert!(
    ROUND_BYTES_MAX as usize + QUEUE_MESSAGE_BYTES_MAX_MAX as usize <= GRPC_MESSAGE_BYTES_MAX / 2,
    "a delivery response (its bytes, passed by one message at most) fits a gRPC message twice"
);

/// Checks a stream's initial credit: 1 to [`CREDIT_MESSAGES_MAX`] messages.
pub(crate) fn check_credit(credit: Option<&Credit>) -> Result<(), WireError> {
    let messages = credit.map_or(0, |credit| credit.messages);
    if !(1..=CREDIT_MESSAGES_MAX).contains(&messages) {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!("credit.messages must be 1 to {CREDIT_MESSAGES_MAX}, got {messages}"),
        ));
    }
    Ok(())
}

/// What a stream's client still lets the server send: messages and payload bytes.
#[derive(Debug, Clone, Copy)]
pub struct StreamCredit {
    /// Messages.
    pub messages: u32,
    /// Payload bytes.
    pub bytes: u32,
}

impl StreamCredit {
    /// The credit of a checked start: bytes 0 means [`CREDIT_BYTES_DEFAULT`]; capped at
    /// [`CREDIT_MESSAGES_MAX`] and [`CREDIT_BYTES_MAX`].
    pub fn initial(credit: Option<Credit>) -> Self {
        let credit = credit.unwrap_or_default();
        let bytes = if credit.bytes == 0 {
            CREDIT_BYTES_DEFAULT
        } else {
            credit.bytes
        };
        Self {
            messages: credit.messages.min(CREDIT_MESSAGES_MAX),
            bytes: bytes.min(CREDIT_BYTES_MAX),
        }
    }

    /// Adds the client's grant, within the caps.
    pub fn grant(&mut self, credit: Credit) {
        self.messages = self
            .messages
            .saturating_add(credit.messages)
            .min(CREDIT_MESSAGES_MAX);
        self.bytes = self
            .bytes
            .saturating_add(credit.bytes)
            .min(CREDIT_BYTES_MAX);
    }

    /// Takes what was sent (a message may pass the byte credit alone: it ends at 0).
    pub fn spend(&mut self, messages: usize, bytes: usize) {
        self.messages = self
            .messages
            .saturating_sub(u32::try_from(messages).unwrap_or(u32::MAX));
        self.bytes = self
            .bytes
            .saturating_sub(u32::try_from(bytes).unwrap_or(u32::MAX));
    }

    /// Whether anything may be sent.
    pub fn is_open(self) -> bool {
        self.messages > 0 && self.bytes > 0
    }
}
