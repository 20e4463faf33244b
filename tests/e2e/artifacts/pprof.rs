//! pprof, decoded by protoc with the official profile.proto.

use std::{
    collections::BTreeMap,
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use super::{expected_sites, gunzip, s, trace_counts};
use crate::{
    counts::{COUNTS_TOTAL_BYTES, COUNTS_TOTAL_CALLS, RECURSE_DEPTH},
    support::{require_bpf, validate_profile, Fixture},
};

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
