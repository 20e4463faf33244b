//! The JSON profile file: a [`Profile`] with a format tag and a schema
//! version, written by `--output` and snapshots, read by `mtrace report`
//! and `mtrace diff`. The schema is `tracer/schema/profile.schema.json`.
//! Writing files is the tracer's `sinks` (one place for every output).
//! Writing is `write.rs`, reading and checking `read.rs`.

mod read;
#[cfg(test)]
mod tests;
mod write;

pub use read::{parse, read, MAX_PROFILE_BYTES};
pub use write::to_json;

/// The `format` field of every profile file.
pub const FORMAT: &str = "mtrace-profile";
/// Bumped on any incompatible change of the file's layout. Version 2 keeps
/// each distinct frame once, in a table (`frames`), and a stack's
/// `frames` are indexes into it; version 1 repeated every frame in full
/// in every stack.
pub const SCHEMA_VERSION: u32 = 2;
/// The oldest version still read.
pub const OLDEST_SCHEMA_VERSION: u32 = 1;

/// Exit code for unreadable, truncated or wrong-version input.
pub const EXIT_BAD_INPUT: i32 = 2;
