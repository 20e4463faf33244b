//! The ptrace follower both modes use: launch mode ([`super::launch`])
//! starts the command under it, the hold by pid ([`super::ExitHold`])
//! seizes a running process with it.
//!
//! `requests.rs` holds the ptrace and wait requests (the one place that
//! calls `libc::ptrace` for a tracee); `seize.rs` seizes running processes
//! and their descendants; `startup.rs` runs a new program to where its
//! allocator is known; `tree.rs` follows a process tree's forks, execs and
//! exits and tells the session of each as a [`TreeEvent`].

mod requests;
mod seize;
mod startup;
mod tree;

pub(crate) use requests::{ptrace, waitpid, HeldSignals};
pub(crate) use seize::{seize_descendants, seize_process, seize_tree, WITH_CHILDREN};
pub(crate) use startup::{wait_for_allocator, Exited};
pub use tree::{wait_tree, AtExec, Handover, TreeEvent};
