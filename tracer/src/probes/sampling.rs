//! Count mode's sampling: the countdowns each CPU starts from and the
//! tables the BPF programs draw their gaps and weights from.

use anyhow::{Context, Result};
use aya::Ebpf;
use tracer_common::{maps, EXP_TABLE_LEN, WEIGHT_ONE, WEIGHT_TABLE_LEN, WEIGHT_TABLE_START};

/// Count mode, sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampling {
    /// On average one sample per N allocated bytes.
    Bytes(u64),
    /// Each call with probability 1/N.
    Every(u64),
}

/// Sampling: every CPU's countdown starts at a draw of the gap it counts
/// down (exponential in bytes, geometric in calls), so the first
/// allocation is no more likely to be sampled than any other.
pub(super) fn seed_countdowns(ebpf: &mut Ebpf, sampling: Sampling) -> Result<()> {
    use aya::maps::{PerCpuArray, PerCpuValues};
    let n = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
    let mut state = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x9e37_79b9_7f4a_7c15)
        ^ (std::process::id() as u64) << 32
        | 1;
    let draws: Vec<i64> = (0..n)
        .map(|_| {
            // xorshift64*: plenty for spreading start points.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let r = state.wrapping_mul(0x2545_f491_4f6c_dd1d);
            let u = ((r >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            match sampling {
                Sampling::Bytes(rate) => (-u.ln() * rate as f64) as i64 + 1,
                Sampling::Every(n) => (-u.ln() * geometric_scale(n)) as i64 + 1,
            }
        })
        .collect();
    let mut map: PerCpuArray<_, i64> =
        PerCpuArray::try_from(ebpf.map_mut(maps::COUNTDOWN).context("COUNTDOWN map")?)?;
    map.set(0, PerCpuValues::try_from(draws)?, 0)?;
    Ok(())
}

/// One-in-N sampling: with `E` exponential, `floor(scale * E) + 1` is a
/// geometric gap of mean N (each call sampled with probability 1/N, apart
/// from the others) when `scale = -1 / ln(1 - 1/N)`.
pub(super) fn geometric_scale(n: u64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    -1.0 / (-1.0 / n as f64).ln_1p()
}

/// `-ln((i + 0.5) / len)` in 16.16: exponential intervals by table lookup.
pub(super) fn exp_table() -> [u32; EXP_TABLE_LEN] {
    let mut t = [0u32; EXP_TABLE_LEN];
    for (i, v) in t.iter_mut().enumerate() {
        let u = (i as f64 + 0.5) / EXP_TABLE_LEN as f64;
        *v = (-u.ln() * WEIGHT_ONE as f64).round() as u32;
    }
    t
}

/// `1 / (1 - exp(-x))` in 16.16 for `x = (WEIGHT_TABLE_START + i + 0.5) / 256`.
pub(super) fn weight_table() -> [u32; WEIGHT_TABLE_LEN] {
    let mut t = [0u32; WEIGHT_TABLE_LEN];
    for (i, v) in t.iter_mut().enumerate() {
        let x = (WEIGHT_TABLE_START as f64 + i as f64 + 0.5) / 256.0;
        *v = (WEIGHT_ONE as f64 / (1.0 - (-x).exp())).round() as u32;
    }
    t
}
