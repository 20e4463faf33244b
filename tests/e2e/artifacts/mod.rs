//! Profiles as artifacts: the JSON profile (`--output`) and what is made
//! from it offline (`mtrace report`, `mtrace diff`), the pprof and
//! speedscope exports, and snapshots written while tracing goes on.
//!
//! Every mtrace profile a test here writes is validated against
//! tracer/schema/profile.schema.json
//! ([`validate_profile`](crate::support::validate_profile)).

mod bad_input;
mod ci_recipe;
mod diff;
mod html;
mod pprof;
mod scale;
mod schema_roundtrip;
mod snapshots;
mod speedscope;
