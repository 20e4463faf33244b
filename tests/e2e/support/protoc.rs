//! pprof files decoded by protoc with the official profile.proto
//! (Debian's golang-github-google-pprof-dev): protoc's text format read,
//! the profile's samples, locations and mappings.

use std::{
    collections::BTreeMap,
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use super::gunzip;

pub(crate) const PROTO_DIR: &str = "/usr/share/gocode/src/github.com/google/pprof/proto";

/// A message of protoc's text format: fields in order.
#[derive(Debug, Default)]
pub(crate) struct TextMsg {
    fields: Vec<(String, TextField)>,
}

#[derive(Debug)]
pub(crate) enum TextField {
    Scalar(String),
    Msg(TextMsg),
}

impl TextMsg {
    /// Parses what `protoc --decode` prints: one field a line, `name:
    /// value` or `name {` up to a line `}`. (Strings are quoted and escaped
    /// on one line: a value never ends with ` {` nor is `}`.)
    pub(crate) fn parse(text: &str) -> TextMsg {
        // The messages being read, outermost first, with their names.
        let mut open: Vec<(String, TextMsg)> = vec![(String::new(), TextMsg::default())];
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if line == "}" {
                let (name, msg) = open.pop().expect("unbalanced `}` in protoc output");
                let parent = &mut open.last_mut().expect("unbalanced `}`").1;
                parent.fields.push((name, TextField::Msg(msg)));
            } else if let Some(name) = line.strip_suffix(" {") {
                open.push((name.to_string(), TextMsg::default()));
            } else {
                let (name, value) = line
                    .split_once(": ")
                    .unwrap_or_else(|| panic!("unexpected line {line:?} in protoc output"));
                let value = TextField::Scalar(unquote(value));
                open.last_mut()
                    .unwrap()
                    .1
                    .fields
                    .push((name.to_string(), value));
            }
        }
        assert_eq!(open.len(), 1, "protoc output ends inside a message");
        open.pop().unwrap().1
    }

    pub(crate) fn msgs(&self, name: &str) -> Vec<&TextMsg> {
        self.fields
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, f)| match f {
                TextField::Msg(m) => m,
                TextField::Scalar(v) => panic!("field {name} is a scalar ({v}), not a message"),
            })
            .collect()
    }

    pub(crate) fn scalars(&self, name: &str) -> Vec<&str> {
        self.fields
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, f)| match f {
                TextField::Scalar(v) => v.as_str(),
                TextField::Msg(_) => panic!("field {name} is a message, not a scalar"),
            })
            .collect()
    }

    pub(crate) fn ints(&self, name: &str) -> Vec<i64> {
        self.scalars(name)
            .iter()
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name}: {v:?} is not an integer"))
            })
            .collect()
    }

    /// A singular integer field; proto3 leaves out zeros.
    pub(crate) fn int(&self, name: &str) -> i64 {
        match self.ints(name)[..] {
            [] => 0,
            [v] => v,
            _ => panic!("field {name} repeated"),
        }
    }
}

/// A string as protoc writes it (`"..."` with C escapes, octal for other
/// bytes) unquoted; any other value as it is.
pub(crate) fn unquote(value: &str) -> String {
    let Some(inner) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) else {
        return value.to_string();
    };
    let mut out = Vec::new();
    let mut bytes = inner.bytes().peekable();
    while let Some(b) = bytes.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        let e = bytes.next().expect("a `\\` at the end of a string");
        out.push(match e {
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'0'..=b'7' => {
                let mut v = u32::from(e - b'0');
                for _ in 0..2 {
                    match bytes.peek() {
                        Some(d @ b'0'..=b'7') => {
                            v = v * 8 + u32::from(d - b'0');
                            bytes.next();
                        }
                        _ => break,
                    }
                }
                v as u8
            }
            b'x' => panic!("protoc wrote a \\x escape in {value}"),
            other => other,
        });
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A pprof profile as protoc decodes it.
pub(crate) struct Pprof {
    pub(crate) strings: Vec<String>,
    /// (type, unit) names.
    sample_types: Vec<(String, String)>,
    /// Function names by function id.
    functions: BTreeMap<i64, String>,
    /// Function ids of each location's lines (innermost first) by id.
    locations: BTreeMap<i64, Vec<i64>>,
    /// Each location's (mapping id, address) by id.
    pub(crate) places: BTreeMap<i64, (i64, u64)>,
    /// Mappings by id.
    pub(crate) mappings: BTreeMap<i64, Mapping>,
    /// (location ids, leaf first; values).
    pub(crate) samples: Vec<(Vec<i64>, Vec<i64>)>,
}

/// A pprof mapping, its strings looked up.
#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) memory_start: u64,
    pub(crate) memory_limit: u64,
    pub(crate) file_offset: u64,
    pub(crate) filename: String,
    pub(crate) build_id: String,
    pub(crate) has_functions: bool,
    pub(crate) has_filenames: bool,
    pub(crate) has_line_numbers: bool,
}

impl Pprof {
    /// Gunzips `path` and decodes it with `protoc --decode`. Panics (never
    /// skips) when protoc or profile.proto is missing.
    pub(crate) fn decode(path: &Path) -> Pprof {
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
        // uint64 fields read as i64 here: addresses stay below 2^63.
        let places = msg
            .msgs("location")
            .iter()
            .map(|l| (l.int("id"), (l.int("mapping_id"), l.int("address") as u64)))
            .collect();
        let flag = |m: &TextMsg, name: &str| m.scalars(name) == ["true"];
        let mappings = msg
            .msgs("mapping")
            .iter()
            .map(|m| {
                let mapping = Mapping {
                    memory_start: m.int("memory_start") as u64,
                    memory_limit: m.int("memory_limit") as u64,
                    file_offset: m.int("file_offset") as u64,
                    filename: string(m.int("filename")),
                    build_id: string(m.int("build_id")),
                    has_functions: flag(m, "has_functions"),
                    has_filenames: flag(m, "has_filenames"),
                    has_line_numbers: flag(m, "has_line_numbers"),
                };
                (m.int("id"), mapping)
            })
            .collect();
        Pprof {
            strings,
            sample_types,
            functions,
            locations,
            places,
            mappings,
            samples,
        }
    }

    /// Function names of a location, innermost first.
    pub(crate) fn location_names(&self, id: i64) -> Vec<&str> {
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
    pub(crate) fn stack_names(&self, locations: &[i64]) -> Vec<&str> {
        locations
            .iter()
            .map(|&id| self.location_names(id)[0])
            .collect()
    }

    /// Summed values by (allocator = function of the first location,
    /// direct caller = function of the second).
    pub(crate) fn by_site(&self) -> BTreeMap<(String, String), Vec<i64>> {
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

    pub(crate) fn sample_type_names(&self) -> Vec<String> {
        self.sample_types
            .iter()
            .map(|(t, u)| format!("{t}/{u}"))
            .collect()
    }
}
