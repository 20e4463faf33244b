//! A parser for the human table mtrace prints on stdout. tests/e2e/table.rs
//! checks the table with it; other tests read the JSON profile, and go
//! through this parser for what only the report shows.

use std::collections::BTreeMap;

use super::Finished;

/// One row of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub func: String,
    pub calls: u64,
    /// As shown: `46.9 KiB` (tests compare it with the profile's bytes
    /// formatted by `tracer_offline::render::text::bytes`).
    pub bytes: String,
    /// `avg 48 B`: bytes per call, as shown.
    pub avg: String,
    /// (name, tid) with --per-thread.
    pub thread: Option<(String, u32)>,
    /// (name, pid) with --per-process.
    pub process: Option<(String, u32)>,
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
    /// `mtrace: pid N, S s`.
    pub header: String,
    /// The rows after the totals by thread, test or group: (`thread`,
    /// `test` or `group`, calls, name as printed).
    pub group_rows: Vec<(String, u64, String)>,
    /// `command: ...`.
    pub command: Option<String>,
    /// `probes: also ...`: what follows `also `.
    pub probes_also: Option<String>,
    /// `processes: N traced (M exited during the trace)[, K not traced]`.
    pub processes: Option<Processes>,
    /// `by process: NAME (pid PID): N calls, BYTES[, EXE][, cgroup PATH]`
    /// (per process), what follows the label.
    pub by_process: Vec<String>,
    /// `not traced: ...` lines: what follows the label.
    pub not_traced: Vec<String>,
    pub rows: Vec<Row>,
    pub total_calls: u64,
    /// As shown (`64.5 KiB`).
    pub total_bytes: String,
    /// `None`: "frees not counted".
    pub frees: Option<u64>,
    /// `by function: malloc 1005, calloc 250, ...` under the totals line.
    pub per_func: BTreeMap<String, u64>,
    pub nested: u64,
    /// `lost: ...` as (what, count).
    pub lost: Vec<(String, u64)>,
    /// `stacks: 99.95% whole (...); cut short: no_cfi 1`: the percentage
    /// and the causes as (what, count).
    pub stacks_whole_pct: Option<String>,
    pub cut_short: Vec<(String, u64)>,
    /// `stacks: at most 3 frames above the caller (--max-stack 3)`: what
    /// follows `stacks: `.
    pub stack_limit: Option<String>,
    /// Launch mode: `stacks: threads held 12 times for mtrace to finish
    /// their walks (none lost)`: what follows `stacks: `.
    pub held: Option<String>,
    /// Launch mode: `stacks: threads blocking SIGURG not held 3 times
    /// (copies may be lost)`: what follows `stacks: `.
    pub not_held: Option<String>,
    /// `single-stepped probes (...): reallocarray 4`: what follows the
    /// colon.
    pub single_stepped: Option<String>,
    /// Live mode: the leak suspects' heading line (`leak suspects
    /// (outstanding at the end...): ...`).
    pub leak_suspects: Option<String>,
    /// Live mode: the `uncertain: N frees lost; ...` line under it.
    pub uncertain: Option<String>,
}

/// The `processes:` line of a process tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Processes {
    pub traced: u64,
    pub exited: u64,
    pub not_traced: u64,
    /// The host engine's `N allocated (one per exec)` (the others 0).
    pub allocated: Option<u64>,
}

impl Processes {
    /// `N traced (M exited during the trace)[, K not traced]`, or on the
    /// host engine `N allocated (one per exec)`.
    fn parse(s: &str, line: &str) -> Result<Processes, String> {
        let bad = || format!("bad processes line {line:?}");
        if let Some(n) = s.strip_suffix(" allocated (one per exec)") {
            return Ok(Processes {
                allocated: Some(num(n, line)?),
                ..Processes::default()
            });
        }
        let (traced, rest) = s.split_once(" traced (").ok_or_else(bad)?;
        let (exited, rest) = rest
            .split_once(" exited during the trace)")
            .ok_or_else(bad)?;
        let not_traced = match rest {
            "" => 0,
            r => num(
                r.strip_prefix(", ")
                    .and_then(|r| r.strip_suffix(" not traced"))
                    .ok_or_else(bad)?,
                line,
            )?,
        };
        Ok(Processes {
            traced: num(traced, line)?,
            exited: num(exited, line)?,
            not_traced,
            allocated: None,
        })
    }
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

/// `N call` when N is 1, `N calls` otherwise: N.
fn counted(s: &str, noun: &str, line: &str) -> Result<u64, String> {
    let (n, word) = s
        .split_once(' ')
        .ok_or_else(|| format!("no count of {noun} in {line:?}"))?;
    let n = num(n, line)?;
    let want = if n == 1 {
        noun.to_string()
    } else {
        format!("{noun}s")
    };
    if word != want {
        return Err(format!("{s:?}: {want:?} expected, in {line:?}"));
    }
    Ok(n)
}

/// `SIZE B`, `SIZE.D KiB`, ... : the size as shown, after checking its form.
fn size(s: &str, line: &str) -> Result<String, String> {
    let (n, unit) = s
        .split_once(' ')
        .ok_or_else(|| format!("bad size {s:?} in {line:?}"))?;
    let ok = match unit {
        "B" => n.parse::<u64>().is_ok_and(|v| v < 1024),
        "KiB" | "MiB" | "GiB" | "TiB" | "PiB" | "EiB" => {
            n.split_once('.').is_some_and(|(_, d)| d.len() == 1) && n.parse::<f64>().is_ok()
        }
        _ => false,
    };
    ok.then(|| s.to_string())
        .ok_or_else(|| format!("bad size {s:?} in {line:?}"))
}

/// `#K  CALLS call(s)  PCT%  SIZE  avg SIZE  FUNC[  thread NAME (tid N)][  [stack truncated]]`
fn parse_row_header(line: &str) -> Result<Row, String> {
    let bad = || format!("bad row header {line:?}");
    let parts: Vec<&str> = line.split("  ").collect();
    if parts.len() < 6 || !parts[0].starts_with('#') {
        return Err(bad());
    }
    // Go heap rows count objects.
    let calls = counted(parts[1], "call", line).or_else(|_| counted(parts[1], "object", line))?;
    parts[2].strip_suffix('%').ok_or_else(bad)?;
    let bytes = size(parts[3], line)?;
    let avg = size(parts[4].strip_prefix("avg ").ok_or_else(bad)?, line)?;
    let mut row = Row {
        func: parts[5].to_string(),
        calls,
        bytes,
        avg,
        thread: None,
        process: None,
        truncated: false,
        frames: Vec::new(),
    };
    for part in &parts[6..] {
        if let Some(t) = part.strip_prefix("thread ") {
            let (name, tid) = t.rsplit_once(" (tid ").ok_or_else(bad)?;
            let tid = num(tid.strip_suffix(')').ok_or_else(bad)?, line)?;
            row.thread = Some((name.to_string(), tid as u32));
        } else if let Some(p) = part.strip_prefix("process ") {
            let (name, pid) = p.rsplit_once(" (pid ").ok_or_else(bad)?;
            let pid = num(pid.strip_suffix(')').ok_or_else(bad)?, line)?;
            row.process = Some((name.to_string(), pid as u32));
        } else if *part == "[stack truncated]" {
            row.truncated = true;
        } else {
            return Err(bad());
        }
    }
    Ok(row)
}

impl Report {
    /// Parses mtrace's stdout. Lines before the `mtrace: pid` header
    /// (`mtrace: the host,`, `mtrace: a cgroup,` for those scopes; a
    /// launched command's own output) are skipped.
    pub fn parse(text: &str) -> Result<Report, String> {
        let mut lines = text.lines().skip_while(|l| !is_header(l));
        let mut r = Report {
            header: lines.next().ok_or("no `mtrace: pid` header")?.to_string(),
            ..Report::default()
        };
        // Labelled lists, each over one or more lines: `label: a, b,` ...
        let mut lists: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        let list_labels = [
            "by function",
            "stacks: cut short",
            "single-stepped probes (20 us a call, not 1)",
            "lost",
            "symbols",
        ];
        let mut seen_total = false;
        let mut live_summary = false;
        // The `by thread (N threads):` (test, group) heading whose rows follow.
        let mut section: Option<String> = None;
        for line in lines {
            if line.is_empty() {
                continue;
            }
            if let Some(noun) = ["thread", "test", "group"]
                .into_iter()
                .find(|n| line.starts_with(&format!("by {n} (")) && line.ends_with("):"))
            {
                section = Some(noun.to_string());
                continue;
            }
            if let Some(noun) = &section {
                let row = line
                    .trim_start()
                    .split_once(" calls ")
                    .filter(|(n, _)| n.bytes().all(|b| b.is_ascii_digit()));
                if let Some((calls, rest)) = row {
                    // `   N calls  SIZE  NAME[, K live (SIZE)]`
                    let name = rest
                        .trim_start()
                        .split_once("  ")
                        .map_or(rest, |(_, name)| name);
                    r.group_rows
                        .push((noun.clone(), num(calls, line)?, name.to_string()));
                    continue;
                }
                section = None;
            }
            if line.starts_with("outside any test: ") {
                continue;
            }
            // Live mode: the heap summary and the leak suspects follow the
            // table (tests/e2e/live.rs reads them from the JSON profile);
            // of those, only the suspects' heading and caveat are kept.
            live_summary |= line.starts_with("live: ");
            if live_summary {
                if line.starts_with("leak suspects") {
                    r.leak_suspects = Some(line.to_string());
                } else if line.starts_with("uncertain: ") {
                    r.uncertain = Some(line.to_string());
                }
                continue;
            }
            // Live mode: statistics under a row.
            if ["    live: ", "    size: ", "    lifetime: ", "    in use: "]
                .iter()
                .any(|p| line.starts_with(p))
            {
                continue;
            }
            if let Some(label) = list_labels
                .iter()
                .find(|l| line.starts_with(&format!("{l}: ")))
            {
                lists
                    .entry(label)
                    .or_default()
                    .push(&line[label.len() + 2..]);
            } else if line.starts_with('#') {
                r.rows.push(parse_row_header(line)?);
            } else if let Some(frame) = line.strip_prefix("    ") {
                let row = r.rows.last_mut().ok_or("a frame before any row")?;
                if frame != "[no frames]" {
                    row.frames.push(frame_name(frame));
                }
            } else if let Some(c) = line.strip_prefix("command: ") {
                r.command = Some(c.to_string());
            } else if let Some(p) = line.strip_prefix("processes: ") {
                r.processes = Some(Processes::parse(p, line)?);
            } else if let Some(p) = line.strip_prefix("by process: ") {
                r.by_process.push(p.to_string());
            } else if let Some(n) = line.strip_prefix("not traced: ") {
                r.not_traced.push(n.to_string());
            } else if let Some(also) = line.strip_prefix("probes: also ") {
                r.probes_also = Some(also.to_string());
            } else if let Some(t) = line.strip_prefix("total: ") {
                let bad = || format!("bad totals line {line:?}");
                let (calls, rest) = t.split_once(", ").ok_or_else(bad)?;
                let (bytes, frees) = rest.split_once(" requested, ").ok_or_else(bad)?;
                r.total_calls = counted(calls, "allocation call", line)?;
                r.total_bytes = size(bytes, line)?;
                r.frees = match frees {
                    "frees not counted" => None,
                    n => Some(counted(n, "free", line)?),
                };
                seen_total = true;
            } else if let Some(n) = line.strip_prefix("nested allocator calls not counted twice: ")
            {
                r.nested = num(n, line)?;
            } else if let Some(l) = line
                .strip_prefix("stacks: ")
                .filter(|l| l.ends_with(")") && l.contains("(--max-stack "))
            {
                r.stack_limit = Some(l.to_string());
            } else if let Some(l) = line
                .strip_prefix("stacks: ")
                .filter(|l| l.contains(" not held "))
            {
                r.not_held = Some(l.to_string());
            } else if let Some(l) = line
                .strip_prefix("stacks: ")
                .filter(|l| l.contains(" held ") && l.contains(" for mtrace to finish "))
            {
                r.held = Some(l.to_string());
            } else if let Some(l) = line.strip_prefix("stacks: ") {
                let (pct, _) = l
                    .split_once("% whole")
                    .ok_or_else(|| format!("bad stacks line {line:?}"))?;
                r.stacks_whole_pct = Some(pct.to_string());
            } else if line.contains(" hidden by --")
                || line == "no allocations traced"
                || [
                    "note: ",
                    "sampled: ",
                    "probes: ",
                    "scope: ",
                    "allocators called: ",
                ]
                .iter()
                .any(|p| line.starts_with(p))
            {
            } else {
                return Err(format!("unexpected line {line:?}"));
            }
        }
        // `what N` items of a list.
        let items = |label: &str| -> Result<Vec<(String, u64)>, String> {
            let Some(parts) = lists.get(label) else {
                return Ok(Vec::new());
            };
            let joined = parts.join(" ");
            joined
                .split(", ")
                .map(|item| {
                    let (what, n) = item
                        .rsplit_once(' ')
                        .ok_or_else(|| format!("bad item {item:?} of {label}"))?;
                    Ok((what.to_string(), num(n, item)?))
                })
                .collect()
        };
        r.per_func = items("by function")?.into_iter().collect();
        r.cut_short = items("stacks: cut short")?;
        r.lost = items("lost")?;
        r.single_stepped = lists
            .get("single-stepped probes (20 us a call, not 1)")
            .map(|parts| parts.join(" "));
        if !seen_total || r.lost.is_empty() {
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

/// Whether `line` is the report's first: `mtrace: pid 1234, ...`, or for
/// a scope of many processes `mtrace: the host, ...`, `mtrace: a cgroup,
/// ...`.
pub fn is_header(line: &str) -> bool {
    ["mtrace: pid ", "mtrace: the host,", "mtrace: a cgroup,"]
        .iter()
        .any(|h| line.starts_with(h))
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
