//! Compiles proto/ with protox (a pure-Rust protobuf compiler, so no `protoc` is needed) and
//! generates prost messages and tonic clients and servers from it.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not when it was compiled: a build script binary is reused
    // by checkouts elsewhere that share the target directory (git worktrees).
    let proto_root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = [
        "levee/v1/errors.proto",
        "levee/v1/common.proto",
        "levee/v1/admin.proto",
        "levee/v1/cluster.proto",
        "levee/v1/limits.proto",
        "levee/v1/hotkey.proto",
        "levee/v1/queue.proto",
        "levee/v1/topic.proto",
        "levee/peer/v1/peer.proto",
    ];
    let file_descriptors = protox::compile(files, [&proto_root])?;
    // Message payloads (and publish keys, and the queue named by each appended message)
    // decode as `bytes::Bytes`: a slice of the received frame, not one allocation and copy per
    // message.
    let payload_fields = [
        ".levee.v1.AppendMessage.queue",
        ".levee.v1.AppendMessage.payload",
        ".levee.v1.Delivery.payload",
        ".levee.v1.MailboxDelivery.payload",
        ".levee.v1.ReadResponse.payloads",
        ".levee.v1.PublishMessage.key",
        ".levee.v1.PublishMessage.payload",
        ".levee.v1.TopicDelivery.payload",
        // Shard peer calls carry entries whose messages decode as slices of the body.
        ".levee.peer.v1.ShardMessage.body",
    ];
    let builder = payload_fields
        .iter()
        .fold(tonic_prost_build::configure(), |builder, field| {
            builder.bytes(field)
        });
    builder
        .emit_rerun_if_changed(false)
        .compile_fds(file_descriptors)?;
    println!("cargo:rerun-if-changed={}", proto_root.display());
    Ok(())
}
