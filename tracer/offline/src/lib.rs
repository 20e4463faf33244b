//! mtrace's offline half: everything that works on a profile once it has
//! been collected and symbolized, and nothing that reaches the kernel.
//!
//! - [`profile`]: the model (stacks of symbolized frames with counts), its
//!   JSON file format and snapshot deltas;
//! - [`diff`]: matching two profiles stack by stack, and the `--fail-if`
//!   gate;
//! - [`render`]: a profile (or a diff) to bytes: table, folded stacks,
//!   flame graphs, pprof, speedscope, leak summary, the HTML report.
//!   Renderers do no I/O.
//! - [`golden`] (feature `golden`, tests only): golden files and
//!   `MTRACE_BLESS`.
//!
//! This crate has no aya, tokio or clap in its dependency tree: `mtrace
//! report` and `mtrace diff` work without root, and the compiler keeps it
//! that way.

pub mod diff;
pub mod error;
#[cfg(feature = "golden")]
pub mod golden;
pub mod profile;
pub mod render;
