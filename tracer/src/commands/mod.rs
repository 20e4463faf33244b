//! The commands, thin: `mtrace [--pid PID | -- CMD]` ([`trace`]), `mtrace
//! report` ([`report`]) and `mtrace diff` ([`diff`]). The offline two need
//! no privilege and touch no kernel interface; nor does `mtrace generate`
//! ([`generate`]: man pages, completions).

pub mod diff;
pub mod generate;
pub mod report;
pub mod trace;
