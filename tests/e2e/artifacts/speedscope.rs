//! speedscope.

use std::{collections::BTreeMap, fs};

use serde_json::Value;

use crate::{
    support::counts::{expected_sites, COUNTS_TOTAL_BYTES, COUNTS_TOTAL_CALLS},
    support::{mtrace::trace_counts, s, Fixture},
};

#[test]
fn speedscope_profiles_sum_to_the_totals() {
    let dir = bpf_tempdir!();
    let path = dir.path().join("counts.speedscope.json");
    trace_counts(Fixture::Counts, &["--speedscope", s(&path)]);
    let v: Value = serde_json::from_str(&fs::read_to_string(&path).expect("no speedscope file"))
        .expect("the speedscope file is not JSON");
    assert_eq!(
        v["$schema"], "https://www.speedscope.app/file-format-schema.json",
        "$schema"
    );
    let frames = v["shared"]["frames"].as_array().expect("shared.frames");
    let profiles = v["profiles"].as_array().expect("profiles");
    assert_eq!(profiles.len(), 2, "two profiles (calls, bytes)");
    let mut sums = Vec::new();
    let mut sites: Vec<BTreeMap<(String, String), i64>> = Vec::new();
    for prof in profiles {
        assert_eq!(prof["type"], "sampled", "{}", prof["name"]);
        let samples = prof["samples"].as_array().expect("samples");
        let weights = prof["weights"].as_array().expect("weights");
        assert_eq!(samples.len(), weights.len());
        let mut sum = 0;
        let mut by_site = BTreeMap::new();
        for (stack, w) in samples.iter().zip(weights) {
            let w = w.as_i64().expect("weight");
            sum += w;
            // Outermost first, the allocator last.
            let names: Vec<&str> = stack
                .as_array()
                .expect("sample")
                .iter()
                .map(|i| {
                    let i = i.as_u64().expect("frame index") as usize;
                    frames.get(i).expect("frame index out of range")["name"]
                        .as_str()
                        .expect("frame name")
                })
                .collect();
            assert!(names.len() >= 2, "{names:?}");
            let key = (
                names[names.len() - 1].to_string(),
                names[names.len() - 2].to_string(),
            );
            *by_site.entry(key).or_default() += w;
        }
        assert_eq!(prof["endValue"].as_i64(), Some(sum), "{}", prof["name"]);
        sums.push(sum);
        sites.push(by_site);
    }
    assert_eq!(
        profiles[0]["unit"], "none",
        "the first profile counts calls"
    );
    assert_eq!(profiles[1]["unit"], "bytes");
    assert_eq!(sums, [COUNTS_TOTAL_CALLS as i64, COUNTS_TOTAL_BYTES as i64]);
    for (i, which) in ["calls", "bytes"].iter().enumerate() {
        let expected: BTreeMap<(String, String), i64> = expected_sites()
            .into_iter()
            .map(|(k, v)| (k, v[i]))
            .collect();
        assert_eq!(
            sites[i], expected,
            "speedscope {which} by (allocator, caller)"
        );
    }
}
