//! The speedscope file format
//! (<https://www.speedscope.app/file-format-schema.json>): sampled
//! profiles over one frame table, one weighted by allocation calls and one
//! by allocated bytes (in live mode also by in-use and by leaked bytes). Every allocation stack is a sample, outermost frame
//! first and the allocator function last; inlined functions are frames of
//! their own.

use std::collections::HashMap;

use anyhow::Result;
use serde::Serialize;

use crate::profile::Profile;

use super::{is_allocation, StackWeight};

const SCHEMA: &str = "https://www.speedscope.app/file-format-schema.json";

#[derive(Serialize)]
struct File<'a> {
    #[serde(rename = "$schema")]
    schema: &'static str,
    shared: Shared<'a>,
    profiles: Vec<SampledProfile>,
    name: String,
    exporter: String,
    #[serde(rename = "activeProfileIndex")]
    active_profile_index: usize,
}

#[derive(Serialize)]
struct Shared<'a> {
    frames: Vec<Frame<'a>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize)]
struct Frame<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    line: Option<u32>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SampledProfile {
    #[serde(rename = "type")]
    kind: &'static str,
    name: &'static str,
    unit: &'static str,
    start_value: u64,
    end_value: u64,
    /// Frame indices, outermost first.
    samples: Vec<Vec<usize>>,
    weights: Vec<u64>,
}

impl SampledProfile {
    fn new(name: &'static str, unit: &'static str) -> Self {
        SampledProfile {
            kind: "sampled",
            name,
            unit,
            start_value: 0,
            end_value: 0,
            samples: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Adds `stack` unless `weight` is 0.
    fn add(&mut self, stack: &[usize], weight: u64) {
        if weight > 0 {
            self.samples.push(stack.to_vec());
            self.weights.push(weight);
            self.end_value = self.end_value.saturating_add(weight);
        }
    }
}

/// The frame table: frames shared by name, file and line.
#[derive(Default)]
struct Frames<'a> {
    frames: Vec<Frame<'a>>,
    index: HashMap<Frame<'a>, usize>,
}

impl<'a> Frames<'a> {
    fn index(&mut self, frame: Frame<'a>) -> usize {
        *self.index.entry(frame).or_insert_with(|| {
            self.frames.push(frame);
            self.frames.len() - 1
        })
    }
}

/// Renders every allocation stack of `profile` as a speedscope file with
/// an "allocation calls" and an "allocated bytes" profile, and in live
/// mode an "in-use bytes" and a "leaked bytes" one (blocks still allocated
/// at the end, and those at least `--min-age` old). The profile of
/// `weight` is the one speedscope opens. `free` entries and zero weights
/// are left out; each profile's end value is the sum of its weights.
pub fn render(profile: &Profile, weight: StackWeight) -> Result<String> {
    let meta = &profile.meta;
    let mut frames = Frames::default();
    let mut profiles = vec![
        (
            StackWeight::Calls,
            SampledProfile::new("allocation calls", "none"),
        ),
        (
            StackWeight::Bytes,
            SampledProfile::new("allocated bytes", "bytes"),
        ),
    ];
    if profile.live.is_some() {
        profiles.push((
            StackWeight::InUse,
            SampledProfile::new("in-use bytes (at the end)", "bytes"),
        ));
        profiles.push((
            StackWeight::Leaked,
            SampledProfile::new("leaked bytes (leak suspects)", "bytes"),
        ));
    }
    let mut stack = Vec::new();
    for entry in profile.stacks.iter().filter(|e| is_allocation(e)) {
        if profiles.iter().all(|(w, _)| w.of(entry) == 0) {
            continue;
        }
        stack.clear();
        for f in entry.frames.iter().rev() {
            stack.push(frames.index(Frame {
                name: name(&f.function),
                file: f.file.as_deref(),
                line: f.line,
            }));
        }
        stack.push(frames.index(Frame {
            name: name(&entry.func),
            file: None,
            line: None,
        }));
        for (w, p) in &mut profiles {
            p.add(&stack, w.of(entry));
        }
    }

    let version = if meta.mtrace_version.is_empty() {
        env!("CARGO_PKG_VERSION")
    } else {
        &meta.mtrace_version
    };
    let active_profile_index = profiles.iter().position(|(w, _)| *w == weight).unwrap_or(0);
    let file = File {
        schema: SCHEMA,
        shared: Shared {
            frames: frames.frames,
        },
        profiles: profiles.into_iter().map(|(_, p)| p).collect(),
        name: format!("mtrace: {} (pid {})", meta.command, meta.pid),
        exporter: format!("mtrace {version}"),
        active_profile_index,
    };
    Ok(serde_json::to_string(&file)?)
}

/// A frame name, `[unknown]` when empty.
fn name(function: &str) -> &str {
    if function.trim().is_empty() {
        "[unknown]"
    } else {
        function
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::Value;

    use super::super::test_util::{entry, on_thread, profile};
    use super::*;

    fn parse(p: &Profile) -> Value {
        let json = render(p, StackWeight::Calls).expect("render");
        serde_json::from_str(&json).expect("valid JSON")
    }

    /// The stacks of profile `i` as frame names, outermost first, with
    /// their weights.
    fn stacks(v: &Value, i: usize) -> Vec<(Vec<String>, u64)> {
        let frames = v["shared"]["frames"].as_array().expect("frames");
        let prof = &v["profiles"][i];
        let samples = prof["samples"].as_array().expect("samples");
        let weights = prof["weights"].as_array().expect("weights");
        assert_eq!(samples.len(), weights.len());
        samples
            .iter()
            .zip(weights)
            .map(|(s, w)| {
                let names = s
                    .as_array()
                    .expect("stack")
                    .iter()
                    .map(|i| {
                        let i = i.as_u64().expect("index") as usize;
                        frames[i]["name"].as_str().expect("name").to_string()
                    })
                    .collect();
                (names, w.as_u64().expect("weight"))
            })
            .collect()
    }

    fn sample() -> Profile {
        let mut p = profile(vec![
            entry("malloc", &["leaf", "mid", "main"], 3, 300),
            entry("calloc", &["other", "main"], 2, 64),
            on_thread(entry("malloc", &["leaf", "mid", "main"], 1, 100), 7, "t"),
            entry("free", &["leaf", "mid", "main"], 6, 0),
        ]);
        p.meta.command = "./app -x".into();
        p.meta.pid = 99;
        p.meta.mtrace_version = "0.9.1".into();
        p
    }

    #[test]
    fn has_the_required_keys() {
        let v = parse(&sample());
        assert_eq!(v["$schema"], SCHEMA);
        assert_eq!(v["name"], "mtrace: ./app -x (pid 99)");
        assert_eq!(v["exporter"], "mtrace 0.9.1");
        assert_eq!(v["activeProfileIndex"], 0);
        assert!(v["shared"]["frames"].is_array());
        let profiles = v["profiles"].as_array().expect("profiles");
        assert_eq!(profiles.len(), 2);
        for (prof, (name, unit)) in profiles
            .iter()
            .zip([("allocation calls", "none"), ("allocated bytes", "bytes")])
        {
            assert_eq!(prof["type"], "sampled");
            assert_eq!(prof["name"], name);
            assert_eq!(prof["unit"], unit);
            assert_eq!(prof["startValue"], 0);
            assert!(prof["endValue"].is_u64());
            let samples = prof["samples"].as_array().expect("samples");
            let weights = prof["weights"].as_array().expect("weights");
            assert_eq!(samples.len(), weights.len());
        }
        for f in v["shared"]["frames"].as_array().expect("frames") {
            assert!(f["name"].is_string());
        }
    }

    #[test]
    fn stacks_are_root_first_and_weights_sum_to_totals() {
        let p = sample();
        let v = parse(&p);
        let calls = stacks(&v, 0);
        let s = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            calls,
            [
                (s(&["main", "mid", "leaf", "malloc"]), 3),
                (s(&["main", "other", "calloc"]), 2),
                (s(&["main", "mid", "leaf", "malloc"]), 1),
            ]
        );
        let bytes = stacks(&v, 1);
        assert_eq!(
            bytes.iter().map(|(_, w)| w).sum::<u64>(),
            p.totals.allocs.bytes
        );
        assert_eq!(
            calls.iter().map(|(_, w)| w).sum::<u64>(),
            p.totals.allocs.calls
        );
        assert_eq!(v["profiles"][0]["endValue"], p.totals.allocs.calls);
        assert_eq!(v["profiles"][1]["endValue"], p.totals.allocs.bytes);
    }

    #[test]
    fn frames_are_shared_by_name_file_and_line() {
        let mut p = profile(vec![
            entry("malloc", &["a", "main"], 1, 1),
            entry("malloc", &["a", "main"], 1, 1),
        ]);
        Arc::make_mut(&mut p.stacks[1].frames[0]).line = Some(12);
        Arc::make_mut(&mut p.stacks[1].frames[0]).file = Some("a.c".into());
        let v = parse(&p);
        let frames = v["shared"]["frames"].as_array().expect("frames");
        // main, a, malloc, a (a.c:12)
        assert_eq!(frames.len(), 4);
        assert_eq!(frames[0], serde_json::json!({"name": "main"}));
        assert_eq!(
            frames[3],
            serde_json::json!({"name": "a", "file": "a.c", "line": 12})
        );
        assert_eq!(
            v["profiles"][0]["samples"],
            serde_json::json!([[0, 1, 2], [0, 3, 2]])
        );
    }

    #[test]
    fn inlined_frames_are_frames_of_their_own() {
        let mut e = entry("malloc", &["inner", "outer"], 1, 8);
        Arc::make_mut(&mut e.frames[0]).inlined = true;
        let v = parse(&profile(vec![e]));
        assert_eq!(stacks(&v, 0)[0].0, ["outer", "inner", "malloc"]);
    }

    #[test]
    fn zero_weights_and_free_are_left_out() {
        let v = parse(&profile(vec![
            entry("malloc", &["a"], 2, 0),
            entry("free", &["a"], 5, 0),
            entry("malloc", &["b"], 0, 0),
        ]));
        assert_eq!(stacks(&v, 0).len(), 1);
        assert_eq!(stacks(&v, 1).len(), 0);
        assert_eq!(v["profiles"][1]["endValue"], 0);
        let names: Vec<&str> = v["shared"]["frames"]
            .as_array()
            .expect("frames")
            .iter()
            .map(|f| f["name"].as_str().expect("name"))
            .collect();
        assert_eq!(names, ["a", "malloc"]);
    }

    #[test]
    fn live_profiles_weigh_in_use_and_leaked_bytes() {
        let mut p = sample();
        p.live = Some(crate::profile::LiveTotals::default());
        p.stacks[0].live = Some(crate::profile::LiveStats {
            outstanding_bytes: 200,
            old_outstanding_bytes: 100,
            ..Default::default()
        });
        let v: Value =
            serde_json::from_str(&render(&p, StackWeight::Leaked).expect("render")).expect("JSON");
        assert_eq!(v["activeProfileIndex"], 3);
        assert_eq!(v["profiles"][2]["name"], "in-use bytes (at the end)");
        assert_eq!(v["profiles"][3]["name"], "leaked bytes (leak suspects)");
        let main = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            stacks(&v, 2),
            [(main(&["main", "mid", "leaf", "malloc"]), 200)]
        );
        assert_eq!(
            stacks(&v, 3),
            [(main(&["main", "mid", "leaf", "malloc"]), 100)]
        );
        // Outside live mode: calls and bytes only.
        assert_eq!(
            parse(&sample())["profiles"].as_array().map(Vec::len),
            Some(2)
        );
    }

    #[test]
    fn empty_profile_is_valid() {
        let v = parse(&Profile::default());
        assert_eq!(v["profiles"][0]["samples"], serde_json::json!([]));
        assert_eq!(v["profiles"][0]["endValue"], 0);
        assert!(v["exporter"]
            .as_str()
            .expect("exporter")
            .starts_with("mtrace "));
    }
}
