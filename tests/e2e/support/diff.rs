//! A parser for what `mtrace diff` prints: the totals, the changed
//! stacks, the gate's verdict.

/// One changed stack of `mtrace diff`'s table.
#[derive(Debug)]
pub struct DiffRow {
    pub func: String,
    /// (base, new).
    pub calls: (u64, u64),
    pub bytes: (u64, u64),
    /// Function names, innermost first.
    pub frames: Vec<String>,
    /// The frame lines as printed (`function [module]`).
    pub frame_lines: Vec<String>,
}

#[derive(Debug, Default)]
pub struct DiffOut {
    /// `total: calls B -> N (...), bytes B -> N (...)`.
    pub total_calls: (u64, u64),
    pub total_bytes: (u64, u64),
    pub rows: Vec<DiffRow>,
    pub unchanged: u64,
    pub regressions: Vec<String>,
    pub ok: bool,
    /// The `no stack changed` line.
    pub no_stack_changed: bool,
    /// What follows the totals in parentheses: (calls, bytes), as `+0,
    /// +0.00%`.
    pub total_change: (String, String),
    /// `noise: N stack changes within --noise-floor F not gated`.
    pub within_noise: u64,
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

/// `calls 1000 -> 1200 (+200, +20.00%)` -> `+200, +20.00%`.
fn change(part: &str) -> String {
    part.rsplit_once(" (")
        .and_then(|(_, c)| c.strip_suffix(')'))
        .unwrap_or_else(|| panic!("no change in {part:?}"))
        .to_string()
}

impl DiffOut {
    pub fn parse(text: &str) -> DiffOut {
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
                d.total_change = (change(calls), change(bytes));
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
                d.no_stack_changed = true;
            } else if let Some(n) = line.strip_prefix("noise: ") {
                d.within_noise = n.split(' ').next().unwrap().parse().unwrap();
            } else {
                panic!("unexpected line {line:?} in\n{text}");
            }
        }
        assert!(seen_total, "no total line in\n{text}");
        d
    }
}

/// The test cases' names and the failures' messages of a JUnit report,
/// read by an XML parser that checks the document is well formed.
pub(crate) fn junit_cases(xml: &str) -> (Vec<String>, Vec<String>) {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_str(xml);
    reader.config_mut().check_end_names = true;
    let (mut cases, mut failures) = (Vec::new(), Vec::new());
    loop {
        match reader
            .read_event()
            .unwrap_or_else(|e| panic!("bad XML: {e}\n{xml}"))
        {
            Event::Start(e) | Event::Empty(e) => {
                let attr = |n: &str| {
                    e.try_get_attribute(n)
                        .unwrap()
                        .map(|a| {
                            a.normalized_value(quick_xml::XmlVersion::Explicit1_0)
                                .unwrap()
                                .into_owned()
                        })
                        .unwrap_or_default()
                };
                match e.name().as_ref() {
                    b"testcase" => cases.push(attr("name")),
                    b"failure" => failures.push(attr("message")),
                    _ => {}
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    (cases, failures)
}
