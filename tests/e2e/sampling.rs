//! Sampling (`--sample-bytes`, `--sample-every`): the estimates of
//! tests/fixtures/sampled.c against its exact numbers.
//!
//! These tests are statistical, not timed. Each sampled command runs once
//! (never retried until it passes), and the bounds are wide enough that a
//! correct mtrace fails them with a probability below 1e-8 per run of the
//! suite.
//!
//! # The bounds
//!
//! A site makes `n` calls of `s` bytes each. Each call is sampled with
//! probability `p` and a sampled call counts with weight `w = 1/p`, so the
//! estimated calls are `C = w * k` with `k ~ Binomial(n, p)` samples:
//! `E[C] = n` and `SE(C) = w * sqrt(n p (1 - p)) = sqrt(n (1 - p) / p)`.
//! The estimated bytes are `s * C` (every call of a site has one size), up
//! to the rounding of each sample's weighted bytes (under one byte each).
//!
//! - `--sample-bytes R` samples the byte stream as a Poisson process: a
//!   block of `s` bytes is sampled with `p = 1 - exp(-s/R)`. With `k`
//!   about `n s / R` samples for small blocks, the relative SE is about
//!   `1 / sqrt(n s / R)`: 7.2% for small_site (195 samples), 2.8% for
//!   medium_site (1212). Blocks much larger than R are (almost) always
//!   sampled with weight ~1: large_site (1 MiB, p = 1 - 1e-7) is exact
//!   to 0.015 calls. (mtrace draws intervals from a 1024-entry table of
//!   exponential quantiles, at most 7.6 R: its p is within 0.05% of the
//!   formula for these sizes, 0.02 SE at most, and 1 for 1 MiB blocks.)
//! - `--sample-every N` samples each call with `p = 1/N`, weight `N`:
//!   `SE = N sqrt(n p (1 - p)) = sqrt(n (N - 1))`: 2.2%, 7.0% and 22% for
//!   the three sites at N = 100 (2000, 200 and 20 expected samples).
//!
//! We assert `|C - n| <= 6 SE + 5 w` and the same times `s` (plus one byte
//! per sample) for the bytes. For a normal variable 6 SE alone would fail
//! with probability 2e-9, but `k` is a binomial with as few as 20 expected
//! samples, whose upper tail is heavier: the exact binomial tails beyond
//! 6 SE sum to 1.7e-7 over the checks below (1.6e-7 of it for large_site at
//! N = 100). The absolute floor of 5 samples' weight (`5 w`) brings the
//! exact sum of all tails to 6e-9 (computed with mpmath over the binomial
//! pmf: small/medium by bytes 1.0e-9 + 1.1e-9; by calls 1.4e-9 + 1.2e-9 +
//! 1.4e-9; the calls and bytes checks of a site are one event). It also
//! covers the rounding of estimated calls to integers.
//!
//! mtrace seeds every CPU's countdown (bytes or calls) with a draw of the
//! gap it counts down, so the first allocation on a CPU is no more likely
//! to be sampled than any other, and no bound allows for forced samples.

use crate::support::{trace_fixture, Fixture, Profile};

/// (direct caller, calls, bytes per call) of tests/fixtures/sampled.c;
/// every call is malloc.
const SITES: &[(&str, u64, u64)] = &[
    ("small_site", 200_000, 64),
    ("medium_site", 20_000, 4096),
    ("large_site", 2_000, 1 << 20),
];

/// Standard errors allowed.
const K_SE: f64 = 6.0;
/// Samples' worth of weight allowed on top (see the module comment).
const SLACK_SAMPLES: f64 = 5.0;

/// How a run samples.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `--sample-bytes R`.
    Bytes(u64),
    /// `--sample-every N`.
    Every(u64),
}

impl Kind {
    /// The chance that one call of `size` bytes is sampled.
    fn p(self, size: u64) -> f64 {
        match self {
            Kind::Bytes(r) => 1.0 - (-(size as f64) / r as f64).exp(),
            Kind::Every(n) => 1.0 / n as f64,
        }
    }
}

/// What a sampled run wrote.
struct Sampled {
    profile: Profile,
    /// `meta.sampling.samples`.
    samples: u64,
}

/// Runs `mtrace ARGS --top 0 -o FILE -- sampled` once.
fn run(args: &[&str]) -> Sampled {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--top", "0"]);
    let (out, profile) = trace_fixture(Fixture::Sampled, &all);
    assert!(
        out.stdout.lines().any(|l| l == "done"),
        "the fixture did not finish\n{}",
        out.describe()
    );
    assert_eq!(profile.mode(), "count");
    let sampling = &profile.doc["meta"]["sampling"];
    assert!(sampling.is_object(), "no meta.sampling in the profile");
    let samples = sampling["samples"].as_u64().expect("meta.sampling.samples");
    Sampled { profile, samples }
}

/// Checks the sampling metadata, then every site's estimate against its
/// exact numbers.
fn check(run: &Sampled, kind: Kind) {
    let r = &run.profile;
    let dump = r.dump();
    let (kind_name, rate) = match kind {
        Kind::Bytes(n) => ("bytes", n),
        Kind::Every(n) => ("every", n),
    };
    let sampling = &r.doc["meta"]["sampling"];
    assert_eq!(sampling["kind"], kind_name, "meta.sampling.kind");
    assert_eq!(sampling["rate"].as_u64(), Some(rate), "meta.sampling.rate");
    // The `sampled:` line of the table: tests/e2e/table.rs.

    // Nothing but the three sites.
    let mut expected_sites: Vec<(String, String)> = SITES
        .iter()
        .map(|&(c, ..)| ("malloc".to_string(), c.to_string()))
        .collect();
    expected_sites.sort();
    assert_eq!(r.sites(), expected_sites, "\n{dump}");
    r.assert_no_losses();
    let (sum_calls, sum_bytes) = r
        .allocs()
        .fold((0, 0), |(c, b), s| (c + s.calls, b + s.bytes));
    assert_eq!((sum_calls, sum_bytes), r.total(), "\n{dump}");

    let mut expected_samples = 0.0;
    let mut samples_var = 0.0;
    for &(caller, n, size) in SITES {
        let (calls, bytes) = r.site("malloc", caller);
        let p = kind.p(size);
        let w = 1.0 / p;
        let nf = n as f64;
        let se = (nf * (1.0 - p) / p).sqrt();
        let low = nf - K_SE * se - SLACK_SAMPLES * w;
        let high = nf + K_SE * se + SLACK_SAMPLES * w;
        eprintln!(
            "{kind:?} {caller}: estimated {calls} calls (exact {n}, SE {se:.1}, {:+.2} SE), \
             bounds [{low:.0}, {high:.0}]",
            (calls as f64 - nf) / se.max(1e-9)
        );
        assert!(
            (low..=high).contains(&(calls as f64)),
            "{kind:?} {caller}: {calls} estimated calls, exact {n}: outside [{low:.0}, {high:.0}] \
             ({K_SE} SE of {se:.1} + {SLACK_SAMPLES} samples of weight {w:.1})\n{dump}"
        );
        let s = size as f64;
        let rounding = run.samples as f64;
        assert!(
            (s * low - rounding..=s * high + rounding).contains(&(bytes as f64)),
            "{kind:?} {caller}: {bytes} estimated bytes, exact {}: outside [{:.0}, {:.0}]\n{dump}",
            n * size,
            s * low - rounding,
            s * high + rounding
        );
        // One size per site: bytes are calls times the size, up to the
        // rounding of each sample's weighted bytes.
        assert!(
            (bytes as f64 - s * calls as f64).abs() <= s + rounding,
            "{kind:?} {caller}: {bytes} bytes for {calls} calls of {size}\n{dump}"
        );
        expected_samples += nf * p;
        samples_var += nf * p * (1.0 - p);
    }

    match kind {
        Kind::Every(n) => {
            // Every sample weighs exactly N.
            assert_eq!(r.total().0, run.samples * n, "\n{dump}");
            for stack in r.allocs() {
                assert_eq!(stack.calls % n, 0, "{stack:?}");
            }
            for &(caller, _, size) in SITES {
                let (calls, bytes) = r.site("malloc", caller);
                assert_eq!(bytes, calls * size, "{caller}\n{dump}");
            }
        }
        Kind::Bytes(_) => {
            let sd = samples_var.sqrt();
            let slack = K_SE * sd + SLACK_SAMPLES;
            let (low, high) = (expected_samples - slack, expected_samples + slack);
            assert!(
                (low..=high).contains(&(run.samples as f64)),
                "{} samples, expected {expected_samples:.0} (SD {sd:.1}): outside [{low:.0}, {high:.0}]",
                run.samples
            );
        }
    }
    // Frees are not counted when sampling.
    assert_eq!(r.totals.frees, 0, "\n{dump}");
}

#[test]
fn sample_bytes_estimates_are_unbiased() {
    need_bpf!();
    let run = run(&["--sample-bytes", "65536"]);
    check(&run, Kind::Bytes(65536));
}

#[test]
fn sample_every_estimates_are_unbiased() {
    need_bpf!();
    let run = run(&["--sample-every", "100"]);
    check(&run, Kind::Every(100));
}
