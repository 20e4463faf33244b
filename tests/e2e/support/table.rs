//! A parser for the human table mtrace prints on stdout, for the tests of
//! the table itself (tests/e2e/table.rs); every other test reads the JSON
//! profile.

use std::collections::BTreeMap;

use super::Finished;

/// One row of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub func: String,
    pub calls: u64,
    pub bytes: u64,
    /// (name, tid) with --per-thread.
    pub thread: Option<(String, u32)>,
    pub truncated: bool,
    /// Function names, innermost (the allocator's direct caller) first.
    pub frames: Vec<String>,
}

impl Row {
    pub fn caller(&self) -> Option<&str> {
        self.frames.first().map(String::as_str)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub header: String,
    pub rows: Vec<Row>,
    pub total_calls: u64,
    pub total_bytes: u64,
    /// `None`: "frees not counted".
    pub frees: Option<u64>,
    /// `(malloc 1005, calloc 250, ...)` of the totals line.
    pub per_func: BTreeMap<String, u64>,
    pub nested: u64,
    /// `lost: ...` as (what, count).
    pub lost: Vec<(String, u64)>,
    /// `stacks: 99.95% whole (...); cut short: no_cfi 1`: the percentage
    /// and the causes as (what, count).
    pub stacks_whole_pct: Option<String>,
    pub cut_short: Vec<(String, u64)>,
    /// `single-stepped probes (...): reallocarray 4`: what follows the
    /// colon.
    pub single_stepped: Option<String>,
}

fn num(s: &str, what: &str) -> Result<u64, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("{what}: {s:?} is not a number"))
}

/// `function (file:line)`, `function [inlined]`, `lib+0x12 [lib]` or
/// `function` -> `function`.
fn frame_name(line: &str) -> String {
    let mut s = line.trim();
    if let Some(rest) = s.strip_suffix(" [inlined]") {
        s = rest;
    }
    if s.ends_with(')') {
        if let Some(i) = s.rfind(" (") {
            s = &s[..i];
        }
    } else if s.ends_with(']') && !s.starts_with('[') {
        if let Some(i) = s.rfind(" [") {
            s = &s[..i];
        }
    }
    s.to_string()
}

/// `#K  CALLS calls  PCT%  BYTES bytes  avg AVG  FUNC[  thread NAME (tid N)][  [stack truncated]]`
fn parse_row_header(line: &str) -> Result<Row, String> {
    let bad = || format!("bad row header {line:?}");
    let parts: Vec<&str> = line.split("  ").collect();
    if parts.len() < 6 || !parts[0].starts_with('#') {
        return Err(bad());
    }
    let calls = num(parts[1].strip_suffix(" calls").ok_or_else(bad)?, line)?;
    parts[2].strip_suffix('%').ok_or_else(bad)?;
    let bytes = num(parts[3].strip_suffix(" bytes").ok_or_else(bad)?, line)?;
    let avg = num(parts[4].strip_prefix("avg ").ok_or_else(bad)?, line)?;
    if calls > 0 && avg != bytes / calls {
        return Err(format!("wrong average in {line:?}"));
    }
    let mut row = Row {
        func: parts[5].to_string(),
        calls,
        bytes,
        thread: None,
        truncated: false,
        frames: Vec::new(),
    };
    for part in &parts[6..] {
        if let Some(t) = part.strip_prefix("thread ") {
            let (name, tid) = t.rsplit_once(" (tid ").ok_or_else(bad)?;
            let tid = num(tid.strip_suffix(')').ok_or_else(bad)?, line)?;
            row.thread = Some((name.to_string(), tid as u32));
        } else if *part == "[stack truncated]" {
            row.truncated = true;
        } else {
            return Err(bad());
        }
    }
    Ok(row)
}

impl Report {
    /// Parses mtrace's stdout. Lines before the `mtrace: pid` header (a
    /// launched command's own output) are skipped.
    pub fn parse(text: &str) -> Result<Report, String> {
        let mut lines = text.lines().skip_while(|l| !l.starts_with("mtrace: pid "));
        let mut r = Report {
            header: lines.next().ok_or("no `mtrace: pid` header")?.to_string(),
            ..Report::default()
        };
        let mut seen_total = false;
        let mut seen_lost = false;
        for line in lines {
            if line.is_empty() {
                continue;
            }
            // Live mode: the heap summary and the leak suspects follow the
            // table (tests/e2e/live.rs reads them from the JSON profile).
            if line.starts_with("live: ") {
                break;
            }
            // Live mode: statistics under a row.
            if line.starts_with("    live: ") || line.starts_with("    size ") {
                continue;
            }
            if line.starts_with('#') {
                r.rows.push(parse_row_header(line)?);
            } else if let Some(frame) = line.strip_prefix("    ") {
                let row = r.rows.last_mut().ok_or("a frame before any row")?;
                if frame != "[no frames]" {
                    row.frames.push(frame_name(frame));
                }
            } else if let Some(t) = line.strip_prefix("total: ") {
                let bad = || format!("bad totals line {line:?}");
                let (calls, rest) = t.split_once(" allocation calls, ").ok_or_else(bad)?;
                let (bytes, rest) = rest.split_once(" bytes requested, ").ok_or_else(bad)?;
                let (frees, rest) = match rest.strip_prefix("frees not counted") {
                    Some(rest) => (None, rest),
                    None => {
                        let (n, rest) = rest.split_once(" frees").ok_or_else(bad)?;
                        (Some(n), rest)
                    }
                };
                r.total_calls = num(calls, line)?;
                r.total_bytes = num(bytes, line)?;
                r.frees = frees.map(|n| num(n, line)).transpose()?;
                if let Some(list) = rest.trim().strip_prefix('(') {
                    for item in list.strip_suffix(')').ok_or_else(bad)?.split(", ") {
                        let (f, n) = item.rsplit_once(' ').ok_or_else(bad)?;
                        r.per_func.insert(f.to_string(), num(n, line)?);
                    }
                }
                seen_total = true;
            } else if let Some(n) = line.strip_prefix("nested allocator calls not counted twice: ")
            {
                r.nested = num(n, line)?;
            } else if let Some(l) = line.strip_prefix("single-stepped probes (") {
                let (_, which) = l.split_once("): ").ok_or("bad single-stepped line")?;
                r.single_stepped = Some(which.to_string());
            } else if let Some(l) = line.strip_prefix("stacks: ") {
                let bad = || format!("bad stacks line {line:?}");
                let (pct, rest) = l.split_once("% whole").ok_or_else(bad)?;
                r.stacks_whole_pct = Some(pct.to_string());
                if let Some((_, causes)) = rest.split_once("; cut short: ") {
                    for item in causes.split(", ") {
                        let (what, n) = item.rsplit_once(' ').ok_or_else(bad)?;
                        r.cut_short.push((what.to_string(), num(n, line)?));
                    }
                }
            } else if let Some(l) = line.strip_prefix("lost: ") {
                for item in l.split(", ") {
                    let (what, n) = item
                        .rsplit_once(' ')
                        .ok_or_else(|| format!("bad lost line {line:?}"))?;
                    r.lost.push((what.to_string(), num(n, line)?));
                }
                seen_lost = true;
            } else if line.contains(" hidden by --")
                || line == "no allocations traced"
                || line.starts_with("note: ")
                || line.starts_with("sampled: ")
            {
            } else {
                return Err(format!("unexpected line {line:?}"));
            }
        }
        if !seen_total || !seen_lost {
            return Err("no totals or no lost line".into());
        }
        Ok(r)
    }
}

impl Finished {
    /// The table on stdout; panics with everything mtrace printed when it
    /// cannot be parsed.
    pub fn report(&self) -> Report {
        Report::parse(&self.stdout)
            .unwrap_or_else(|e| panic!("cannot parse the report: {e}\n{}", self.describe()))
    }
}

/// The table of a launch-mode run: stdout without the fixture's own
/// `done` line, which comes before mtrace's header.
pub fn live_table(out: &Finished) -> String {
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
