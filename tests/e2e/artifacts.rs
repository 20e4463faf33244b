//! Profiles as artifacts: the JSON profile (`--output`) and what is made
//! from it offline (`mtrace report`, `mtrace diff`), the pprof and
//! speedscope exports, and snapshots written while tracing goes on.
//!
//! Every mtrace profile a test here writes is validated against
//! tracer/schema/profile.schema.json ([`validate_profile`]).

use std::{
    collections::BTreeMap,
    fs,
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{
    counts::{
        check_counts_report, COUNTS_SITES, COUNTS_TOTAL_BYTES, COUNTS_TOTAL_CALLS, RECURSE_DEPTH,
    },
    support::{
        copy_executable, require_bpf, run_mtrace, Finished, Fixture, FixtureProc, Mtrace, Report,
        EXIT_TIMEOUT, LINE_TIMEOUT,
    },
};

// ---------------------------------------------------------------------------
// The profile schema

pub fn schema_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("schema/profile.schema.json")
}

/// Loads the profile at `path`, asserts that it validates against the
/// schema (listing every error), and returns it.
pub fn validate_profile(path: &Path) -> Value {
    let schema_text = fs::read_to_string(schema_path())
        .unwrap_or_else(|e| panic!("reading {}: {e}", schema_path().display()));
    let schema: Value = serde_json::from_str(&schema_text).expect("the schema is not JSON");
    let validator = jsonschema::validator_for(&schema).expect("the schema does not compile");
    let text = fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading profile {}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("profile {} is not JSON: {e}", path.display()));
    let errors: Vec<String> = validator
        .iter_errors(&doc)
        .map(|e| format!("  at {:?}: {e}", e.instance_path().to_string()))
        .collect();
    assert!(
        errors.is_empty(),
        "{} does not validate against {}:\n{}",
        path.display(),
        schema_path().display(),
        errors.join("\n")
    );
    doc
}

/// `path` as &str (temp paths are UTF-8).
fn s(path: &Path) -> &str {
    path.to_str().expect("path not UTF-8")
}

/// (allocator function, direct caller) -> [calls, bytes] of the counts
/// fixture.
fn expected_sites() -> BTreeMap<(String, String), [i64; 2]> {
    COUNTS_SITES
        .iter()
        .map(|&(f, c, calls, bytes)| ((f.to_string(), c.to_string()), [calls as i64, bytes as i64]))
        .collect()
}

/// A launch-mode trace of `fixture` (counts or counts-plus20) with `args`
/// before `--`; asserts that mtrace exits 0.
fn trace_counts(fixture: Fixture, args: &[&str]) -> Finished {
    let mut all: Vec<&str> = args.to_vec();
    all.push("--");
    all.push(fixture.path_str());
    let mut m = Mtrace::start(&all);
    m.wait_tracing();
    let out = m.finish();
    out.assert_exit(0);
    out
}

/// The table of a launch-mode run: stdout without the fixture's own
/// `done` line, which comes before mtrace's header.
fn live_table(out: &Finished) -> String {
    let lines: Vec<&str> = out.stdout.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.starts_with("mtrace: pid "))
        .unwrap_or_else(|| panic!("no report header\n{}", out.describe()));
    assert_eq!(
        &lines[..header],
        &["done"],
        "expected only the fixture's `done` before the report\n{}",
        out.describe()
    );
    let mut table = String::new();
    for l in &lines[header..] {
        table.push_str(l);
        table.push('\n');
    }
    table
}

/// `mtrace report ARGS` (no privilege needed): exit 0, and the table.
fn report(args: &[&str]) -> Finished {
    let mut all = vec!["report"];
    all.extend_from_slice(args);
    let out = run_mtrace(&all);
    out.assert_exit(0);
    out
}

fn gunzip(path: &Path) -> Vec<u8> {
    let file = fs::File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{} is not gzip: {e}", path.display()));
    raw
}

// ---------------------------------------------------------------------------
// 2. Round trip: live run -> profile -> `mtrace report`

#[test]
fn report_reproduces_the_live_run() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    let live = trace_counts(
        Fixture::Counts,
        &[
            "--top",
            "0",
            "--output",
            s(&p("f.json")),
            "--folded",
            s(&p("live.folded")),
            "--pprof",
            s(&p("live.pb.gz")),
            "--speedscope",
            s(&p("live.speedscope.json")),
        ],
    );
    check_counts_report(&live.report());
    let f = validate_profile(&p("f.json"));
    assert_eq!(f["meta"]["mode"], "count");
    assert_eq!(f["totals"]["allocs"]["calls"], COUNTS_TOTAL_CALLS);
    assert_eq!(f["totals"]["allocs"]["bytes"], COUNTS_TOTAL_BYTES);

    let rep = report(&[
        s(&p("f.json")),
        "--top",
        "0",
        "-o",
        s(&p("g.json")),
        "--folded",
        s(&p("rep.folded")),
        "--flamegraph",
        s(&p("rep.svg")),
        "--pprof",
        s(&p("rep.pb.gz")),
        "--speedscope",
        s(&p("rep.speedscope.json")),
    ]);
    assert_eq!(
        rep.stdout,
        live_table(&live),
        "`mtrace report` prints another table than the live run\n--- live ---\n{}",
        live.describe()
    );
    for what in [
        "profile",
        "folded stacks",
        "flamegraph",
        "pprof profile",
        "speedscope profile",
    ] {
        assert!(
            rep.stderr
                .iter()
                .any(|l| l.starts_with(&format!("mtrace: wrote {what} to "))),
            "report did not say it wrote the {what}\n{}",
            rep.describe()
        );
    }

    // Re-written, the profile is the same document.
    let g = validate_profile(&p("g.json"));
    assert_eq!(g, f, "report -o does not write back the profile it read");

    // Every file made from the saved profile equals the live run's.
    let folded = fs::read_to_string(p("rep.folded")).expect("no folded file from report");
    assert_eq!(
        folded,
        fs::read_to_string(p("live.folded")).unwrap(),
        "folded stacks differ between live run and report"
    );
    let folded_calls: u64 = folded
        .lines()
        .map(|l| {
            l.rsplit_once(' ')
                .and_then(|(_, n)| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("bad folded line {l:?}"))
        })
        .sum();
    assert_eq!(folded_calls, COUNTS_TOTAL_CALLS, "{folded}");
    assert!(
        folded
            .lines()
            .any(|l| l.ends_with(";alloc_small;malloc 1000")),
        "{folded}"
    );
    assert_eq!(
        gunzip(&p("rep.pb.gz")),
        gunzip(&p("live.pb.gz")),
        "pprof profiles differ between live run and report"
    );
    let ss = |name: &str| -> Value {
        serde_json::from_str(&fs::read_to_string(p(name)).unwrap())
            .unwrap_or_else(|e| panic!("{name} is not JSON: {e}"))
    };
    assert_eq!(
        ss("rep.speedscope.json"),
        ss("live.speedscope.json"),
        "speedscope profiles differ between live run and report"
    );
    let svg = fs::read_to_string(p("rep.svg")).expect("no flamegraph from report");
    assert!(svg.contains("<svg"), "not an SVG");
    assert!(svg.contains("alloc_small"), "alloc_small not in the SVG");

    // Another order and cut: still the same table.
    let live = trace_counts(
        Fixture::Counts,
        &["--sort", "bytes", "--top", "3", "-o", s(&p("h.json"))],
    );
    validate_profile(&p("h.json"));
    let rep = report(&[s(&p("h.json")), "--sort", "bytes", "--top", "3"]);
    assert_eq!(
        rep.stdout,
        live_table(&live),
        "`mtrace report --sort bytes --top 3` differs from the live run\n--- live ---\n{}",
        live.describe()
    );
    let r = rep.report();
    let callers: Vec<&str> = r
        .rows
        .iter()
        .map(|row| row.caller().unwrap_or(""))
        .collect();
    // 62500 (alloc_zeroed), 48000 (alloc_small), 20480 (leaf_alloc).
    assert_eq!(
        callers,
        ["alloc_zeroed", "alloc_small", "leaf_alloc"],
        "\n{}",
        rep.stdout
    );
    assert!(
        rep.stdout.contains(" hidden by --top\n"),
        "no `hidden by --top` line\n{}",
        rep.stdout
    );
}

// ---------------------------------------------------------------------------
// 3. pprof, decoded by protoc with the official profile.proto

const PROTO_DIR: &str = "/usr/share/gocode/src/github.com/google/pprof/proto";

/// A message of protoc's text format: fields in order.
#[derive(Debug, Default)]
struct TextMsg {
    fields: Vec<(String, TextField)>,
}

#[derive(Debug)]
enum TextField {
    Scalar(String),
    Msg(TextMsg),
}

#[derive(Debug, PartialEq)]
enum Tok {
    Open,
    Close,
    Colon,
    Word(String),
    Str(String),
}

fn tokenize(text: &str) -> Vec<Tok> {
    let b = text.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            c if c.is_ascii_whitespace() => i += 1,
            b'{' => {
                toks.push(Tok::Open);
                i += 1
            }
            b'}' => {
                toks.push(Tok::Close);
                i += 1
            }
            b':' => {
                toks.push(Tok::Colon);
                i += 1
            }
            q @ (b'"' | b'\'') => {
                // C escapes, as protoc writes them (octal for other bytes).
                let mut out = Vec::new();
                i += 1;
                while i < b.len() && b[i] != q {
                    if b[i] == b'\\' {
                        i += 1;
                        match b[i] {
                            b'n' => out.push(b'\n'),
                            b'r' => out.push(b'\r'),
                            b't' => out.push(b'\t'),
                            b'0'..=b'7' => {
                                let mut v = 0u32;
                                let mut k = 0;
                                while k < 3 && i < b.len() && (b'0'..=b'7').contains(&b[i]) {
                                    v = v * 8 + (b[i] - b'0') as u32;
                                    i += 1;
                                    k += 1;
                                }
                                out.push(v as u8);
                                continue;
                            }
                            b'x' => {
                                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
                                out.push(u8::from_str_radix(hex, 16).unwrap());
                                i += 2;
                            }
                            other => out.push(other),
                        }
                        i += 1;
                    } else {
                        out.push(b[i]);
                        i += 1;
                    }
                }
                assert!(i < b.len(), "unterminated string in protoc output");
                i += 1;
                toks.push(Tok::Str(String::from_utf8_lossy(&out).into_owned()));
            }
            _ => {
                let start = i;
                while i < b.len() && !b[i].is_ascii_whitespace() && !b"{}:\"'".contains(&b[i]) {
                    i += 1;
                }
                toks.push(Tok::Word(text[start..i].to_string()));
            }
        }
    }
    toks
}

fn parse_msg(toks: &[Tok], pos: &mut usize, top: bool) -> TextMsg {
    let mut msg = TextMsg::default();
    loop {
        match toks.get(*pos) {
            None if top => return msg,
            None => panic!("protoc output ends inside a message"),
            Some(Tok::Close) if !top => {
                *pos += 1;
                return msg;
            }
            Some(Tok::Word(name)) => {
                *pos += 1;
                if toks.get(*pos) == Some(&Tok::Colon) {
                    *pos += 1;
                }
                let field = match toks.get(*pos) {
                    Some(Tok::Open) => {
                        *pos += 1;
                        TextField::Msg(parse_msg(toks, pos, false))
                    }
                    Some(Tok::Word(v)) | Some(Tok::Str(v)) => {
                        *pos += 1;
                        TextField::Scalar(v.clone())
                    }
                    other => panic!("unexpected {other:?} after field {name} in protoc output"),
                };
                msg.fields.push((name.clone(), field));
            }
            other => panic!("unexpected {other:?} in protoc output"),
        }
    }
}

impl TextMsg {
    fn parse(text: &str) -> TextMsg {
        let toks = tokenize(text);
        let mut pos = 0;
        parse_msg(&toks, &mut pos, true)
    }

    fn msgs(&self, name: &str) -> Vec<&TextMsg> {
        self.fields
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, f)| match f {
                TextField::Msg(m) => m,
                TextField::Scalar(v) => panic!("field {name} is a scalar ({v}), not a message"),
            })
            .collect()
    }

    fn scalars(&self, name: &str) -> Vec<&str> {
        self.fields
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, f)| match f {
                TextField::Scalar(v) => v.as_str(),
                TextField::Msg(_) => panic!("field {name} is a message, not a scalar"),
            })
            .collect()
    }

    fn ints(&self, name: &str) -> Vec<i64> {
        self.scalars(name)
            .iter()
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name}: {v:?} is not an integer"))
            })
            .collect()
    }

    /// A singular integer field; proto3 leaves out zeros.
    fn int(&self, name: &str) -> i64 {
        match self.ints(name)[..] {
            [] => 0,
            [v] => v,
            _ => panic!("field {name} repeated"),
        }
    }
}

/// A pprof profile as protoc decodes it.
struct Pprof {
    strings: Vec<String>,
    /// (type, unit) names.
    sample_types: Vec<(String, String)>,
    /// Function names by function id.
    functions: BTreeMap<i64, String>,
    /// Function ids of each location's lines (innermost first) by id.
    locations: BTreeMap<i64, Vec<i64>>,
    /// (location ids, leaf first; values).
    samples: Vec<(Vec<i64>, Vec<i64>)>,
}

impl Pprof {
    /// Gunzips `path` and decodes it with `protoc --decode`. Panics (never
    /// skips) when protoc or profile.proto is missing.
    fn decode(path: &Path) -> Pprof {
        let raw = gunzip(path);
        assert!(
            Path::new(PROTO_DIR).join("profile.proto").is_file(),
            "{PROTO_DIR}/profile.proto not found: install the Debian package \
             golang-github-google-pprof-dev (apt-get install golang-github-google-pprof-dev)"
        );
        let mut child = match Command::new("protoc")
            .args([
                "--decode",
                "perftools.profiles.Profile",
                &format!("--proto_path={PROTO_DIR}"),
                "profile.proto",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
        {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "protoc not found: install the Debian package protobuf-compiler \
                 (apt-get install protobuf-compiler)"
            ),
            Err(e) => panic!("cannot run protoc: {e}"),
        };
        let mut stdin = child.stdin.take().unwrap();
        let writer = std::thread::spawn(move || stdin.write_all(&raw));
        let out = child.wait_with_output().expect("waiting for protoc");
        writer.join().unwrap().expect("writing to protoc");
        assert!(
            out.status.success(),
            "protoc could not decode {} ({}):\n{}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let msg = TextMsg::parse(&String::from_utf8_lossy(&out.stdout));

        let strings: Vec<String> = msg
            .scalars("string_table")
            .into_iter()
            .map(str::to_string)
            .collect();
        assert_eq!(
            strings.first().map(String::as_str),
            Some(""),
            "string_table[0]"
        );
        let string = |i: i64| -> String {
            strings
                .get(i as usize)
                .unwrap_or_else(|| panic!("string index {i} out of range"))
                .clone()
        };
        let sample_types = msg
            .msgs("sample_type")
            .iter()
            .map(|t| (string(t.int("type")), string(t.int("unit"))))
            .collect();
        let functions = msg
            .msgs("function")
            .iter()
            .map(|f| (f.int("id"), string(f.int("name"))))
            .collect();
        let locations = msg
            .msgs("location")
            .iter()
            .map(|l| {
                let funcs = l
                    .msgs("line")
                    .iter()
                    .map(|line| line.int("function_id"))
                    .collect();
                (l.int("id"), funcs)
            })
            .collect();
        let samples = msg
            .msgs("sample")
            .iter()
            .map(|s| (s.ints("location_id"), s.ints("value")))
            .collect();
        Pprof {
            strings,
            sample_types,
            functions,
            locations,
            samples,
        }
    }

    /// Function names of a location, innermost first.
    fn location_names(&self, id: i64) -> Vec<&str> {
        self.locations
            .get(&id)
            .unwrap_or_else(|| panic!("no location {id}"))
            .iter()
            .map(|f| {
                self.functions
                    .get(f)
                    .unwrap_or_else(|| panic!("no function {f}"))
                    .as_str()
            })
            .collect()
    }

    /// The function name of each location of a sample (for a location of
    /// several lines, the innermost), leaf first.
    fn stack_names(&self, locations: &[i64]) -> Vec<&str> {
        locations
            .iter()
            .map(|&id| self.location_names(id)[0])
            .collect()
    }

    /// Summed values by (allocator = function of the first location,
    /// direct caller = function of the second).
    fn by_site(&self) -> BTreeMap<(String, String), Vec<i64>> {
        let mut out: BTreeMap<(String, String), Vec<i64>> = BTreeMap::new();
        for (locs, values) in &self.samples {
            assert!(locs.len() >= 2, "a sample without a caller: {locs:?}");
            let names = self.stack_names(&locs[..2]);
            let sums = out
                .entry((names[0].to_string(), names[1].to_string()))
                .or_insert_with(|| vec![0; values.len()]);
            for (s, v) in sums.iter_mut().zip(values) {
                *s += v;
            }
        }
        out
    }

    fn sample_type_names(&self) -> Vec<String> {
        self.sample_types
            .iter()
            .map(|(t, u)| format!("{t}/{u}"))
            .collect()
    }
}

#[test]
fn pprof_has_the_exact_counts() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pb = dir.path().join("counts.pb.gz");
    trace_counts(Fixture::Counts, &["--top", "0", "--pprof", s(&pb)]);
    let p = Pprof::decode(&pb);
    assert_eq!(
        p.sample_type_names(),
        ["alloc_objects/count", "alloc_space/bytes"]
    );
    for (locs, values) in &p.samples {
        assert_eq!(values.len(), 2, "sample {locs:?} has values {values:?}");
    }
    let by_site = p.by_site();
    let got: BTreeMap<(String, String), [i64; 2]> = by_site
        .iter()
        .map(|(k, v)| (k.clone(), [v[0], v[1]]))
        .collect();
    assert_eq!(
        got,
        expected_sites(),
        "pprof (allocator, caller) -> [alloc_objects, alloc_space]"
    );

    // By direct caller alone (aligned_allocs has two allocators).
    let mut by_caller: BTreeMap<&str, [i64; 2]> = BTreeMap::new();
    for ((_, caller), v) in &got {
        let e = by_caller.entry(caller.as_str()).or_default();
        e[0] += v[0];
        e[1] += v[1];
    }
    assert_eq!(by_caller["alloc_small"], [1000, 48000]);
    assert_eq!(by_caller["alloc_zeroed"], [250, 62500]);
    assert_eq!(by_caller["grow_buffer"], [10, 5500]);
    assert_eq!(by_caller["leaf_alloc"], [5, 20480]);
    assert_eq!(by_caller["aligned_allocs"], [10, 1084]);
    assert_eq!(by_caller["array_allocs"], [4, 1280]);
    assert_eq!(by_caller["page_allocs"], [2, 2000]);
    let total: [i64; 2] = got.values().fold([0, 0], |a, v| [a[0] + v[0], a[1] + v[1]]);
    assert_eq!(
        total,
        [COUNTS_TOTAL_CALLS as i64, COUNTS_TOTAL_BYTES as i64]
    );

    // The deep stack: malloc, leaf_alloc, recurse x 20, main.
    for (locs, _) in &p.samples {
        let names = p.stack_names(locs);
        if names[1] == "leaf_alloc" {
            assert!(names.len() > RECURSE_DEPTH + 2, "{names:?}");
            assert!(
                names[2..2 + RECURSE_DEPTH].iter().all(|n| *n == "recurse"),
                "{names:?}"
            );
            assert_eq!(names[2 + RECURSE_DEPTH], "main", "{names:?}");
        }
    }
    assert!(
        p.strings.iter().any(|s| s.starts_with("mtrace ")),
        "no comment"
    );
}

#[test]
fn pprof_of_live_mode_has_inuse_values() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pb = dir.path().join("live.pb.gz");
    let json = dir.path().join("live.json");
    trace_counts(
        Fixture::Counts,
        &["--live", "--pprof", s(&pb), "-o", s(&json)],
    );
    let doc = validate_profile(&json);
    assert_eq!(doc["meta"]["mode"], "live");
    let p = Pprof::decode(&pb);
    assert_eq!(
        p.sample_type_names(),
        [
            "alloc_objects/count",
            "alloc_space/bytes",
            "inuse_objects/count",
            "inuse_space/bytes"
        ]
    );
    // counts.c frees every block: nothing in use at the end.
    let got: BTreeMap<(String, String), Vec<i64>> = p.by_site();
    let expected: BTreeMap<(String, String), Vec<i64>> = expected_sites()
        .into_iter()
        .map(|(k, [c, b])| (k, vec![c, b, 0, 0]))
        .collect();
    assert_eq!(got, expected);
}

// ---------------------------------------------------------------------------
// 4. speedscope

#[test]
fn speedscope_profiles_sum_to_the_totals() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
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

// ---------------------------------------------------------------------------
// 5. mtrace diff as a CI gate

/// One changed stack of `mtrace diff`'s table.
#[derive(Debug)]
struct DiffRow {
    func: String,
    /// (base, new).
    calls: (u64, u64),
    bytes: (u64, u64),
    /// Function names, innermost first.
    frames: Vec<String>,
    /// The frame lines as printed (`function [module]`).
    frame_lines: Vec<String>,
}

#[derive(Debug, Default)]
struct DiffOut {
    /// `total: calls B -> N (...), bytes B -> N (...)`.
    total_calls: (u64, u64),
    total_bytes: (u64, u64),
    rows: Vec<DiffRow>,
    unchanged: u64,
    regressions: Vec<String>,
    ok: bool,
}

/// `calls 1000 -> 1200 (+200, +20.00%)` or `calls +200 (+20.00%, 1000 -> 1200)` -> (1000, 1200).
fn base_new(part: &str) -> (u64, u64) {
    let arrow = part
        .find(" -> ")
        .unwrap_or_else(|| panic!("no `->` in {part:?}"));
    let base = part[..arrow]
        .rsplit([' ', '('])
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("bad base in {part:?}"));
    let new = part[arrow + 4..]
        .split([' ', ')', ','])
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("bad new value in {part:?}"));
    (base, new)
}

impl DiffOut {
    fn parse(text: &str) -> DiffOut {
        let mut d = DiffOut::default();
        let mut seen_total = false;
        for line in text.lines() {
            if line.is_empty() || line.starts_with("mtrace diff: ") {
            } else if let Some(t) = line.strip_prefix("total: ") {
                let (calls, bytes) = t
                    .split_once(", bytes ")
                    .unwrap_or_else(|| panic!("bad total line {line:?}"));
                d.total_calls = base_new(calls);
                d.total_bytes = base_new(bytes);
                seen_total = true;
            } else if line.starts_with('#') {
                let parts: Vec<&str> = line.split("  ").collect();
                assert!(parts.len() >= 4, "bad diff row {line:?}");
                d.rows.push(DiffRow {
                    func: parts[3].to_string(),
                    calls: base_new(parts[1]),
                    bytes: base_new(parts[2]),
                    frames: Vec::new(),
                    frame_lines: Vec::new(),
                });
            } else if let Some(frame) = line.strip_prefix("    ") {
                let name = match frame.rsplit_once(" [") {
                    Some((n, _)) if frame.ends_with(']') => n,
                    _ => frame,
                };
                let row = d
                    .rows
                    .last_mut()
                    .unwrap_or_else(|| panic!("a frame before any row: {line:?}"));
                row.frames.push(name.to_string());
                row.frame_lines.push(frame.to_string());
            } else if let Some(n) = line
                .strip_suffix(" stacks unchanged")
                .or_else(|| line.strip_suffix(" stack unchanged"))
            {
                d.unchanged = n.parse().unwrap();
            } else if line.starts_with("regression: ") {
                d.regressions.push(line.to_string());
            } else if line.starts_with("ok: no regression") {
                d.ok = true;
            } else if line == "no stack changed" {
            } else {
                panic!("unexpected line {line:?} in\n{text}");
            }
        }
        assert!(seen_total, "no total line in\n{text}");
        d
    }
}

fn run_diff(args: &[&str]) -> (Finished, DiffOut) {
    let mut all = vec!["diff"];
    all.extend_from_slice(args);
    let out = run_mtrace(&all);
    let d = DiffOut::parse(&out.stdout);
    (out, d)
}

/// Distinct (allocator, caller) sites of counts.c; `mtrace diff` sums the
/// two valloc stacks (same functions) into one.
fn n_sites() -> u64 {
    expected_sites().len() as u64
}

#[test]
fn diff_of_two_runs_is_empty() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.json");
    let b = dir.path().join("b.json");
    trace_counts(Fixture::Counts, &["-o", s(&a)]);
    trace_counts(Fixture::Counts, &["-o", s(&b)]);
    validate_profile(&a);
    validate_profile(&b);
    let (out, d) = run_diff(&[
        s(&a),
        s(&b),
        "--fail-if",
        "calls>+5%",
        "--fail-if",
        "bytes>+1MiB",
    ]);
    out.assert_exit(0);
    let total = (COUNTS_TOTAL_CALLS, COUNTS_TOTAL_CALLS);
    assert_eq!(d.total_calls, total, "{}", out.describe());
    assert_eq!(
        d.total_bytes,
        (COUNTS_TOTAL_BYTES, COUNTS_TOTAL_BYTES),
        "{}",
        out.describe()
    );
    assert!(
        out.stdout.contains("(+0, +0.00%)"),
        "no zero change shown\n{}",
        out.describe()
    );
    assert!(d.rows.is_empty(), "changed stacks\n{}", out.describe());
    assert!(
        out.stdout.contains("\nno stack changed\n"),
        "{}",
        out.describe()
    );
    assert_eq!(d.unchanged, n_sites(), "{}", out.describe());
    assert!(d.ok && d.regressions.is_empty(), "{}", out.describe());
}

/// `base` is counts.c, `new` the same program with 200 more calls at
/// alloc_small (1000 -> 1200): +15.6% calls in total.
fn check_growth_diff(base: &Path, new: &Path, dir: &Path) {
    let expect_only_alloc_small = |out: &Finished, d: &DiffOut| {
        assert_eq!(
            d.total_calls,
            (COUNTS_TOTAL_CALLS, COUNTS_TOTAL_CALLS + 200),
            "{}",
            out.describe()
        );
        assert_eq!(
            d.total_bytes,
            (COUNTS_TOTAL_BYTES, COUNTS_TOTAL_BYTES + 200 * 48),
            "{}",
            out.describe()
        );
        // The sites that did not change must line up across the two
        // binaries: only alloc_small is a changed stack.
        let changed: Vec<String> = d
            .rows
            .iter()
            .map(|r| {
                format!(
                    "calls {} -> {}: {} <- {}",
                    r.calls.0,
                    r.calls.1,
                    r.func,
                    r.frame_lines[..r.frame_lines.len().min(2)].join(" <- ")
                )
            })
            .collect();
        assert_eq!(
            d.rows.len(),
            1,
            "expected one changed stack (alloc_small: calls 1000 -> 1200), the others \
             lining up as unchanged; got {} changed stacks:\n{}\n{}",
            d.rows.len(),
            changed.join("\n"),
            out.describe()
        );
        let row = &d.rows[0];
        assert_eq!(row.func, "malloc");
        assert_eq!(row.frames.first().map(String::as_str), Some("alloc_small"));
        assert_eq!(row.frames.get(1).map(String::as_str), Some("main"));
        assert_eq!(row.calls, (1000, 1200), "{}", out.describe());
        assert_eq!(row.bytes, (48000, 57600), "{}", out.describe());
        assert_eq!(d.unchanged, n_sites() - 1, "{}", out.describe());
    };

    // Totals: +15.6% > 5%.
    let (out, d) = run_diff(&[s(base), s(new), "--top", "0", "--fail-if", "calls>+5%"]);
    out.assert_exit(1);
    expect_only_alloc_small(&out, &d);
    assert_eq!(
        d.regressions,
        ["regression: calls>+5%: total calls 1281 -> 1481 (+15.61%)"],
        "{}",
        out.describe()
    );
    assert!(!d.ok);
    assert!(
        out.stderr.iter().any(|l| l == "mtrace: 1 regression found"),
        "{}",
        out.describe()
    );

    // Totals: +15.6% <= 20%.
    let (out, d) = run_diff(&[s(base), s(new), "--top", "0", "--fail-if", "calls>+20%"]);
    out.assert_exit(0);
    expect_only_alloc_small(&out, &d);
    assert!(d.ok && d.regressions.is_empty(), "{}", out.describe());

    // Per stack: alloc_small +20% > 10%, and no other stack.
    let (out, d) = run_diff(&[
        s(base),
        s(new),
        "--top",
        "0",
        "--per-stack",
        "--fail-if",
        "calls>+10%",
    ]);
    out.assert_exit(1);
    expect_only_alloc_small(&out, &d);
    assert_eq!(d.regressions.len(), 1, "{}", out.describe());
    let line = &d.regressions[0];
    assert!(
        line.starts_with("regression: calls>+10%: malloc <- alloc_small <- main")
            && line.ends_with(": 1000 -> 1200 (+20.00%)"),
        "{line:?}\n{}",
        out.describe()
    );
    for &(_, caller, _, _) in COUNTS_SITES {
        assert!(
            caller == "alloc_small" || !line.contains(caller),
            "{line:?} names {caller}"
        );
    }

    // Differential folded stacks and flame graph.
    let folded = dir.join("d.folded");
    let svg = dir.join("d.svg");
    let (out, _) = run_diff(&[
        s(base),
        s(new),
        "--folded",
        s(&folded),
        "--flamegraph",
        s(&svg),
    ]);
    out.assert_exit(0);
    let text = fs::read_to_string(&folded).expect("no differential folded file");
    let mut lines = 0;
    for line in text.lines() {
        let mut it = line.rsplitn(3, ' ');
        let n: u64 = it.next().unwrap().parse().unwrap();
        let b: u64 = it.next().unwrap().parse().unwrap();
        let stack = it.next().unwrap();
        if stack.ends_with(";alloc_small;malloc") {
            assert_eq!((b, n), (1000, 1200), "{line:?}");
        } else {
            assert_eq!(b, n, "an unchanged stack changed: {line:?}\n{text}");
        }
        lines += 1;
    }
    assert_eq!(lines, n_sites(), "{text}");
    let svg_text = fs::read_to_string(&svg).expect("no differential flamegraph");
    assert!(svg_text.contains("<svg"), "not an SVG");
    assert!(
        svg_text.contains("alloc_small"),
        "alloc_small not in the SVG"
    );
}

/// Two builds of one program at different paths (tests/fixtures/counts.c
/// built as `counts` and as `counts-plus20`): stacks must line up.
#[test]
fn diff_gate_catches_growth_across_builds() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.json");
    let c = dir.path().join("c.json");
    trace_counts(Fixture::Counts, &["-o", s(&a)]);
    let out = trace_counts(Fixture::CountsPlus20, &["--top", "0", "-o", s(&c)]);
    assert_eq!(out.report().site("malloc", "alloc_small"), (1200, 57600));
    validate_profile(&a);
    validate_profile(&c);
    check_growth_diff(&a, &c, dir.path());
}

/// The same gate where the new build has the old one's file name in
/// another directory.
#[test]
fn diff_gate_catches_growth_same_name_other_directory() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let bin_dir = tempfile::tempdir().unwrap();
    let plus20 = copy_executable(Fixture::CountsPlus20.path(), bin_dir.path(), "counts");
    let a = dir.path().join("a.json");
    let c = dir.path().join("c.json");
    trace_counts(Fixture::Counts, &["-o", s(&a)]);
    let mut m = Mtrace::start(&["-o", s(&c), "--", s(&plus20)]);
    m.wait_tracing();
    m.finish().assert_exit(0);
    validate_profile(&a);
    validate_profile(&c);
    check_growth_diff(&a, &c, dir.path());
}

// ---------------------------------------------------------------------------
// 6. Unreadable input: exit 2, one line on stderr

#[test]
fn bad_profiles_exit_2() {
    if !require_bpf() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    let good = p("a.json");
    trace_counts(Fixture::Counts, &["-o", s(&good)]);
    validate_profile(&good);
    let text = fs::read(&good).unwrap();

    fs::write(p("truncated.json"), &text[..text.len() / 2]).unwrap();
    // Not UTF-8, and UTF-8 that is not JSON.
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    fs::write(p("garbage.json"), &garbage).unwrap();
    fs::write(
        p("garbage-text.json"),
        "{\"format\": \"mtrace-profile\", ][ garbage",
    )
    .unwrap();
    let text = String::from_utf8(text).unwrap();
    assert!(text.contains("\"schema_version\": 1,"));
    let v99 = text.replacen("\"schema_version\": 1,", "\"schema_version\": 99,", 1);
    fs::write(p("v99.json"), v99).unwrap();

    let cases: &[(&str, &str)] = &[
        ("truncated.json", "truncated"),
        ("garbage.json", ""),
        ("garbage-text.json", "not a JSON profile"),
        ("v99.json", "version 99"),
        ("does-not-exist.json", ""),
    ];
    for &(name, needle) in cases {
        let bad = p(name);
        let runs: [Vec<&str>; 3] = [
            vec!["report", s(&bad)],
            vec!["diff", s(&good), s(&bad)],
            vec!["diff", s(&bad), s(&good)],
        ];
        for args in &runs {
            let out = run_mtrace(args);
            out.assert_exit(2);
            // One line, naming the file and what is wrong.
            out.assert_error(s(&bad));
            out.assert_error(needle);
        }
    }
    // The good file still works.
    report(&[s(&good)]);

    let out = run_mtrace(&["diff", s(&good), s(&good), "--fail-if", "calls>>5"]);
    out.assert_exit(2);
    out.assert_error("bad --fail-if 'calls>>5'");
}

// ---------------------------------------------------------------------------
// 7. Snapshots (--interval, SIGUSR1) of a process traced by pid

/// `mtrace-PID-NNNN.json` -> NNNN.
fn snapshot_index(name: &str, pid: u32) -> Option<u32> {
    let n = name
        .strip_prefix(&format!("mtrace-{pid}-"))?
        .strip_suffix(".json")?;
    (n.len() == 4 && n.bytes().all(|b| b.is_ascii_digit())).then(|| n.parse().unwrap())
}

fn counts_of(v: &Value) -> (u64, u64) {
    (
        v["calls"].as_u64().expect("calls"),
        v["bytes"].as_u64().expect("bytes"),
    )
}

#[test]
fn snapshots_while_tracing_by_pid() {
    if !require_bpf() {
        return;
    }
    let snap_dir = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let final_json = out_dir.path().join("final.json");

    let mut fx = FixtureProc::start(Fixture::Longrun.path(), &[]);
    fx.wait_ready();
    let pid = fx.pid();
    let mut m = Mtrace::start(&[
        "--pid",
        &pid.to_string(),
        "--interval",
        "0.5",
        "--snapshot-dir",
        s(snap_dir.path()),
        "-o",
        s(&final_json),
    ]);
    assert_eq!(m.wait_tracing(), pid);
    fx.release();
    // Once a snapshot is written the signal handlers are surely in place;
    // then one on demand.
    m.stderr
        .wait_for(|l| l.starts_with("mtrace: wrote snapshot "), LINE_TIMEOUT);
    assert!(fx.proc.running(), "the fixture's loop ended too soon");
    unsafe { libc::kill(m.proc.id() as i32, libc::SIGUSR1) };
    // The loop's end.
    let line = fx
        .stdout
        .wait_for(|l| l.starts_with("iterations="), EXIT_TIMEOUT);
    let iterations: u64 = line
        .strip_prefix("iterations=")
        .and_then(|l| l.split_once(' '))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("bad line {line:?}"));
    // Ctrl-C just after the interval wrote one more (the target now
    // idle): the next tick is 0.5 s away, so the interval cannot have
    // written more than duration / 0.5 snapshots (see below).
    let written = || {
        fs::read_dir(snap_dir.path())
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                snapshot_index(name.to_str().unwrap(), pid).is_some()
            })
            .count()
    };
    let before = written();
    let deadline = Instant::now() + LINE_TIMEOUT;
    while written() == before {
        assert!(
            Instant::now() < deadline,
            "no snapshot after the loop's end"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(m.proc.running(), "mtrace ended before Ctrl-C");
    unsafe { libc::kill(m.proc.id() as i32, libc::SIGINT) };
    let out = m.finish();
    out.assert_exit(0);
    drop(fx.stdin.take());
    assert_eq!(fx.proc.wait_timeout(EXIT_TIMEOUT).code(), Some(0));
    let r: Report = out.report();
    r.assert_no_losses();

    // The files: mtrace-PID-0001.json, -0002.json, ... and nothing else.
    let mut indices: Vec<u32> = fs::read_dir(snap_dir.path())
        .unwrap()
        .map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            snapshot_index(&name, pid)
                .unwrap_or_else(|| panic!("unexpected file {name:?} in the snapshot directory"))
        })
        .collect();
    indices.sort();
    let n = indices.len() as u32;
    assert!(n >= 3, "only {n} snapshots\n{}", out.describe());
    assert_eq!(indices, (1..=n).collect::<Vec<_>>(), "numbering");
    let announced = out
        .stderr
        .iter()
        .filter(|l| l.starts_with("mtrace: wrote snapshot "))
        .count();
    assert_eq!(announced as u32, n, "{}", out.describe());

    let mut prev: Option<((u64, u64), u64)> = None;
    let mut prev_elapsed = 0.0;
    for i in 1..=n {
        let path = snap_dir.path().join(format!("mtrace-{pid}-{i:04}.json"));
        let doc = validate_profile(&path);
        let snap = &doc["snapshot"];
        assert!(
            snap.is_object(),
            "{} has no snapshot object",
            path.display()
        );
        assert_eq!(snap["index"].as_u64(), Some(i as u64), "{}", path.display());
        let elapsed = snap["elapsed_secs"].as_f64().unwrap();
        assert!(elapsed >= prev_elapsed, "elapsed_secs goes back");
        prev_elapsed = elapsed;
        assert_eq!(doc["meta"]["pid"].as_u64(), Some(pid as u64));
        let totals = counts_of(&doc["totals"]["allocs"]);
        let frees = doc["totals"]["frees"].as_u64().unwrap();
        let (p_totals, p_frees) = prev.unwrap_or(((0, 0), 0));
        assert!(
            totals.0 >= p_totals.0 && totals.1 >= p_totals.1 && frees >= p_frees,
            "snapshot {i}: totals {totals:?}/{frees} below the previous {p_totals:?}/{p_frees}"
        );
        assert_eq!(
            counts_of(&snap["delta_allocs"]),
            (totals.0 - p_totals.0, totals.1 - p_totals.1),
            "snapshot {i}: delta_allocs is not the change of the totals"
        );
        assert_eq!(
            snap["delta_frees"].as_u64(),
            Some(frees - p_frees),
            "snapshot {i}"
        );
        prev = Some((totals, frees));
    }
    let (last, last_frees) = prev.unwrap();
    assert!(last.0 > 0, "the snapshots saw no allocation");

    let fin = validate_profile(&final_json);
    // The interval ticks at 0.5, 1.0, ... s after tracing started (a
    // little after meta's start) and wrote at most duration / 0.5
    // snapshots: one more is SIGUSR1's.
    let duration = fin["meta"]["duration_secs"].as_f64().unwrap();
    let by_interval = (duration / 0.5).floor() as u32;
    assert!(
        n > by_interval,
        "{n} snapshots in {duration:.3} s at --interval 0.5: none for SIGUSR1?\n{}",
        out.describe()
    );
    assert!(
        fin.get("snapshot").is_none(),
        "the final profile is not a snapshot"
    );
    let fin_totals = counts_of(&fin["totals"]["allocs"]);
    let fin_frees = fin["totals"]["frees"].as_u64().unwrap();
    assert!(
        fin_totals.0 >= last.0 && fin_totals.1 >= last.1 && fin_frees >= last_frees,
        "final {fin_totals:?}/{fin_frees} below the last snapshot {last:?}/{last_frees}"
    );
    // Attached before the loop, which does malloc, realloc and calloc and
    // two frees per iteration, and nothing else.
    assert_eq!(
        fin_totals.0,
        3 * iterations,
        "calls over {iterations} iterations"
    );
    assert_eq!(
        fin_frees,
        2 * iterations,
        "frees over {iterations} iterations"
    );
    assert_eq!(
        (r.total_calls, r.frees),
        (3 * iterations, 2 * iterations),
        "the report"
    );
    for f in ["malloc", "realloc", "calloc"] {
        assert_eq!(
            r.per_func.get(f),
            Some(&iterations),
            "{f}: {:?}",
            r.per_func
        );
    }
}
