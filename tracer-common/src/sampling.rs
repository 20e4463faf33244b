//! Sampled mode: modes and the fixed-point tables the tracer computes.

/// Fixed-point one for sample weights (16.16).
pub const WEIGHT_ONE: u64 = 1 << 16;

/// `Config::sample_mode`.
pub const SAMPLE_NONE: u32 = 0;
/// On average one sample per `sample_param` allocated bytes (exponential
/// intervals, as jemalloc and tcmalloc draw them).
pub const SAMPLE_BYTES: u32 = 1;
/// Each call sampled with probability 1 / `sample_param`: the calls of a
/// CPU count down geometric gaps (a Bernoulli process, drawn per sample
/// instead of per call).
pub const SAMPLE_EVERY: u32 = 2;

/// Entries of the exponential-interval table: `-ln((i + 0.5) / N)` in 16.16.
/// Exponential draws for both sampling modes.
pub const EXP_TABLE_LEN: usize = 1024;
/// Entries of the bytes-sampling weight table, for `x = size / rate` from
/// 0.5 in steps of 1/256: `1 / (1 - exp(-x))` in 16.16.
pub const WEIGHT_TABLE_LEN: usize = 4096;
/// `x` (in 1/256) where the weight table starts; below it a series is used.
pub const WEIGHT_TABLE_START: u64 = 128;
