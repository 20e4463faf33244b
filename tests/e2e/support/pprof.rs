//! `go tool pprof -raw`, run and parsed: what a real pprof client reads
//! of the agent's profiles.

use std::{collections::BTreeMap, path::Path, process::Command};

/// One sample of `go tool pprof -raw`: its values and the functions of
/// its locations, leaf (the allocator) first.
#[derive(Debug)]
pub(crate) struct Sample {
    pub(crate) values: Vec<i64>,
    pub(crate) functions: Vec<String>,
    pub(crate) labels: String,
}

/// `go tool pprof -raw [extra] URL` with `env` set, as it ran.
pub(crate) fn pprof_fetch(
    dir: &Path,
    url: &str,
    extra: &[&str],
    env: &[(&str, &Path)],
) -> std::process::Output {
    Command::new("go")
        .args(["tool", "pprof", "-raw"])
        .args(extra)
        .arg(url)
        .env("PPROF_TMPDIR", dir)
        .env("HOME", dir)
        .envs(env.iter().copied())
        .output()
        .expect("running go tool pprof")
}

/// `go tool pprof -raw [extra] URL`, parsed: the sample types and the
/// samples.
pub(crate) fn pprof_raw(dir: &Path, url: &str, extra: &[&str]) -> (Vec<String>, Vec<Sample>) {
    pprof_raw_env(dir, url, extra, &[])
}

/// [`pprof_raw`] with `env` set.
pub(crate) fn pprof_raw_env(
    dir: &Path,
    url: &str,
    extra: &[&str],
    env: &[(&str, &Path)],
) -> (Vec<String>, Vec<Sample>) {
    let out = pprof_fetch(dir, url, extra, env);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "go tool pprof failed ({}): {}\n{text}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    parse_raw(&text)
}

pub(crate) fn parse_raw(text: &str) -> (Vec<String>, Vec<Sample>) {
    let mut lines = text.lines().peekable();
    let mut types = Vec::new();
    let mut raw: Vec<(Vec<i64>, Vec<u64>, String)> = Vec::new();
    let mut names: BTreeMap<u64, String> = BTreeMap::new();
    let mut section = "";
    while let Some(line) = lines.next() {
        match line {
            "Samples:" => {
                section = "samples";
                let header = lines.next().unwrap_or_default();
                types = header
                    .split_whitespace()
                    .map(|t| t.trim_end_matches("[dflt]").to_string())
                    .collect();
                continue;
            }
            "Locations" => {
                section = "locations";
                continue;
            }
            "Mappings" => {
                section = "mappings";
                continue;
            }
            _ => {}
        }
        match section {
            "samples" => {
                if let Some((values, locs)) = line.split_once(':').filter(|(v, _)| {
                    !v.trim().is_empty() && v.split_whitespace().all(|x| x.parse::<i64>().is_ok())
                }) {
                    raw.push((
                        values
                            .split_whitespace()
                            .map(|v| v.parse().unwrap())
                            .collect(),
                        locs.split_whitespace()
                            .map(|v| v.parse().unwrap())
                            .collect(),
                        String::new(),
                    ));
                } else if let Some(last) = raw.last_mut() {
                    last.2.push_str(line.trim());
                    last.2.push(' ');
                }
            }
            "locations" => {
                // "    12: 0x12f2 M=1 agent_site_a /path/agent.c:18 s=0"
                let mut parts = line.split_whitespace();
                if let Some(id) = parts
                    .next()
                    .and_then(|i| i.trim_end_matches(':').parse().ok())
                {
                    let function = parts.nth(2).unwrap_or_default().to_string();
                    names.insert(id, function);
                }
            }
            _ => {}
        }
    }
    let samples = raw
        .into_iter()
        .map(|(values, locs, labels)| Sample {
            values,
            functions: locs.iter().map(|l| names[l].clone()).collect(),
            labels,
        })
        .collect();
    (types, samples)
}

/// The values of the sample whose second location (the allocator's
/// caller) is `site`, summed.
pub(crate) fn at_site(samples: &[Sample], site: &str) -> Vec<i64> {
    let mut sum: Vec<i64> = Vec::new();
    for s in samples
        .iter()
        .filter(|s| s.functions.get(1).map(String::as_str) == Some(site))
    {
        sum.resize(s.values.len(), 0);
        for (a, v) in sum.iter_mut().zip(&s.values) {
            *a += v;
        }
    }
    sum
}
