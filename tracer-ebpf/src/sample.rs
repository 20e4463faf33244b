//! Sampling: whether a call is taken, and its weight.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use tracer_common::{
    EXP_TABLE_LEN, SAMPLE_BYTES, SAMPLE_EVERY, SAMPLE_NONE, WEIGHT_ONE, WEIGHT_TABLE_LEN,
    WEIGHT_TABLE_START,
};

use crate::maps::{config_u32, CONFIG, COUNTDOWN};

/// Sampling: `None` to skip this call, else its weight in 16.16 (one
/// without sampling). An unsampled call costs a countdown, nothing more.
#[inline(always)]
pub(crate) fn sample_weight(size: u64) -> Option<u64> {
    let mode = config_u32(&CONFIG.sample_mode);
    if mode == SAMPLE_NONE {
        return Some(WEIGHT_ONE);
    }
    let rate = unsafe { core::ptr::read_volatile(&CONFIG.sample_param) };
    if rate == 0 {
        return Some(WEIGHT_ONE);
    }
    if mode != SAMPLE_EVERY && mode != SAMPLE_BYTES {
        return Some(WEIGHT_ONE);
    }
    // What is left until the next sample on this CPU: calls (one-in-N) or
    // bytes. A countdown costs an unsampled call a load and a store; a
    // random number and a division per call cost more.
    let left = COUNTDOWN.get_ptr_mut(0)?;
    let used = if mode == SAMPLE_EVERY { 1 } else { size as i64 };
    let remaining = unsafe { *left } - used;
    if remaining > 0 {
        unsafe { *left = remaining };
        return None;
    }
    let i = (unsafe { bpf_get_prandom_u32() } as usize) & (EXP_TABLE_LEN - 1);
    let e = unsafe { core::ptr::read_volatile(&CONFIG.exp_table[i]) } as u64;
    if mode == SAMPLE_EVERY {
        // The next geometric gap: floor(scale * E) + 1 calls.
        let scale = unsafe { core::ptr::read_volatile(&CONFIG.sample_scale) };
        unsafe { *left = (weighted_bytes(scale, e) >> 16) as i64 + 1 };
        return Some(rate << 16);
    }
    // Sampled: the next exponential interval of bytes.
    unsafe { *left = ((rate.wrapping_mul(e)) >> 16) as i64 + 1 };
    Some(bytes_weight(size, rate))
}

/// Weight of a block of `size` bytes sampled at one per `rate` bytes:
/// `1 / (1 - exp(-size / rate))`, the inverse of its chance to be sampled,
/// which makes calls and bytes estimates unbiased.
#[inline(always)]
fn bytes_weight(size: u64, rate: u64) -> u64 {
    if size == 0 {
        return WEIGHT_ONE;
    }
    // checked_div: a division the compiler cannot prove safe would leave a
    // panic path, which the verifier rejects.
    let x256 = (size << 8).checked_div(rate).unwrap_or(u64::MAX);
    if x256 < WEIGHT_TABLE_START {
        // x < 1/2: 1/x + 1/2 + x/12, within 2e-5.
        return (rate << 16).checked_div(size).unwrap_or(0)
            + WEIGHT_ONE / 2
            + (size << 16).checked_div(rate.wrapping_mul(12)).unwrap_or(0);
    }
    let i = (x256 - WEIGHT_TABLE_START) as usize;
    if i >= WEIGHT_TABLE_LEN {
        return WEIGHT_ONE;
    }
    unsafe { core::ptr::read_volatile(&CONFIG.weight_table[i]) as u64 }
}

/// `size * weight >> 16` without overflowing.
#[inline(always)]
pub(crate) fn weighted_bytes(size: u64, weight: u64) -> u64 {
    (size >> 16).wrapping_mul(weight) + (((size & 0xffff) * weight) >> 16)
}
