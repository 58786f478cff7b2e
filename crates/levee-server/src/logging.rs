//! Structured logging with tracing: human text (coloured on a terminal) or one JSON object per
//! line, always on standard error.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, LogLevel};

/// Installs the global subscriber. Call once, before anything logs.
pub fn init(level: &LogLevel, format: LogFormat) -> Result<(), String> {
    let filter = EnvFilter::try_new(level.as_str()).map_err(|error| error.to_string())?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
    result.map_err(|error| error.to_string())
}
