//! The commands, thin: `mtrace [--pid PID | -- CMD]` ([`trace`]), `mtrace
//! report` ([`report`]) and `mtrace diff` ([`diff`]). The offline two need
//! no privilege and touch no kernel interface.

pub mod diff;
pub mod report;
pub mod trace;
