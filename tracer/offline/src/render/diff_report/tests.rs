use super::*;
use crate::diff::gate::{judge, parse_condition, GateOptions};
use crate::profile::Counts;

fn key(func: &str, frames: &[&str]) -> StackKey {
    StackKey {
        func: func.into(),
        frames: frames
            .iter()
            .map(|f| {
                std::sync::Arc::new(crate::diff::KeyFrame {
                    function: f.to_string(),
                    module: Some("<program>".into()),
                })
            })
            .collect(),
        truncated: false,
    }
}

fn change(b: (u64, u64), n: (u64, u64)) -> Change {
    Change {
        base: Counts {
            calls: b.0,
            bytes: b.1,
        },
        new: Counts {
            calls: n.0,
            bytes: n.1,
        },
    }
}

/// parse_record grew by 600 calls (of 40 bytes), `weird|name` by 10, and
/// one stack is unchanged.
fn grown() -> Diff {
    let rows = vec![
        DiffRow {
            key: key("malloc", &["parse_record", "main"]),
            change: change((4000, 160_000), (4600, 184_000)),
        },
        DiffRow {
            key: key("malloc", &["weird|name`<&>\u{1b}", "main"]),
            change: change((0, 0), (10, 10)),
        },
        DiffRow {
            key: key("calloc", &["zeroed", "main"]),
            change: change((50, 500), (50, 500)),
        },
    ];
    let total = change((4050, 160_500), (4660, 184_510));
    Diff {
        total,
        in_stacks: total,
        rows,
        whole_pct: (Some(100.0), Some(99.5)),
        ..Diff::default()
    }
}

fn report<'a>(d: &'a Diff, outcomes: &'a [Outcome]) -> DiffReport<'a> {
    let side = |path| Side {
        path,
        command: "./bench --n 4",
        start_time: "2026-11-28T18:00:00Z",
    };
    DiffReport {
        base: side("base.json"),
        new: side("new.json"),
        diff: d,
        outcomes,
        top: 20,
        noise_floor: 0,
    }
}

fn outcomes(d: &Diff, conds: &[&str], per_stack: bool) -> Vec<Outcome> {
    let conds: Vec<_> = conds.iter().map(|c| parse_condition(c).unwrap()).collect();
    let options = GateOptions {
        per_stack,
        noise_floor: 0,
        ..GateOptions::default()
    };
    judge(d, &conds, options)
}

#[test]
fn json_follows_its_schema_and_carries_every_result() {
    let d = grown();
    let o = outcomes(&d, &["calls>+5%", "bytes>+1MiB"], false);
    let text = json(&report(&d, &o));
    let doc: Value = serde_json::from_str(&text).unwrap();
    let schema: Value =
        serde_json::from_str(include_str!("../../../../schema/diff.schema.json")).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = v.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}\n{text}");
    assert_eq!(doc["totals"]["calls"]["delta"], 610);
    assert_eq!(doc["changed"].as_array().unwrap().len(), 2);
    assert_eq!(doc["unchanged_stacks"], 1);
    assert_eq!(doc["changed"][1]["calls"]["change_pct"], Value::Null);
    let gate = &doc["gate"];
    assert_eq!(gate["passed"], false);
    assert_eq!(gate["regressions"], 1);
    assert_eq!(gate["conditions"][0]["passed"], false);
    assert_eq!(gate["conditions"][1]["passed"], true);
    let v0 = &gate["conditions"][0]["violations"][0];
    assert_eq!(v0["stack"], Value::Null);
    assert_eq!(
        v0["grew_most"][0]["stack"]["frames"][0]["function"],
        "parse_record"
    );
    assert_eq!(v0["grew_most"][0]["delta"], 600);
    assert_eq!(
        v0["message"],
        "regression: calls>+5%: total calls 4050 -> 4660 (+610, +15.06%); \
         grew most: +600 malloc <- parse_record <- main, \
         +10 malloc <- weird|name`<&>\u{1b} <- main"
    );
}

#[test]
fn a_bytes_regression_is_said_in_units() {
    let d = grown();
    let o = outcomes(&d, &["bytes>+1KiB"], false);
    assert_eq!(
        o[0].violations[0].to_string(),
        "regression: bytes>+1KiB: total bytes 156.7 KiB -> 180.2 KiB (+23.4 KiB, +14.96%); \
         grew most: +23.4 KiB malloc <- parse_record <- main, \
         +10 B malloc <- weird|name`<&>\u{1b} <- main"
    );
}

#[test]
fn markdown_has_the_verdict_the_totals_and_table_rows() {
    let d = grown();
    let o = outcomes(&d, &["calls>+5%"], true);
    let md = markdown(&report(&d, &o));
    assert!(
        md.starts_with("### mtrace diff: ❌ 2 regressions\n"),
        "{md}"
    );
    // Every table row has the header's number of cells: a pipe in a name
    // is escaped.
    let rows: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
    let cells = |l: &str| l.replace("\\|", "").matches('|').count();
    assert!(rows.iter().all(|l| cells(l) == 5), "{md}");
    assert!(
        md.contains("| total calls | 4050 | 4660 | +610 (+15.06%) |"),
        "{md}"
    );
    assert!(
        md.contains("| 1 | 4000 → 4600 (+600, +15.00%) | 156.2 KiB → 179.7 KiB (+23.4 KiB, +15.00%) | `malloc` ← `parse_record` ← `main` |"),
        "{md}"
    );
    // A name with a backtick is fenced by two.
    assert!(md.contains("``weird\\|name`<&>\u{1b}``"), "{md}");
    assert!(md.contains("1 stack unchanged."), "{md}");

    let held = outcomes(&d, &["calls>+50%"], false);
    let md = markdown(&report(&d, &held));
    assert!(
        md.starts_with("### mtrace diff: ✅ no regression\n"),
        "{md}"
    );
    assert!(md.contains("- ✅ `calls>+50%` (totals): held"), "{md}");
}

/// With tests and groups, the markdown has a table of each, a row per
/// test (group) with its verdict: the failed ones first, naming the
/// conditions they failed; groups no condition gates are `not gated`.
#[test]
fn markdown_has_a_row_per_test_and_group_with_its_verdict() {
    let named = |name: &str, b, n| GroupChange {
        name: name.into(),
        change: change(b, n),
    };
    let d = Diff {
        tests: vec![
            named("tests::steady", (1001, 16_000), (1001, 16_000)),
            named("tests::grows", (5001, 80_000), (10_002, 160_001)),
        ],
        groups: vec![named("parser", (4000, 160_000), (4600, 184_000))],
        ..grown()
    };
    let conds: Vec<_> = ["calls>+1%", "bytes>+1%"]
        .iter()
        .map(|c| parse_condition(c).unwrap())
        .collect();
    let o = judge(
        &d,
        &conds,
        GateOptions {
            per_test: true,
            ..GateOptions::default()
        },
    );
    let md = markdown(&report(&d, &o));
    let table = |title: &str| -> Vec<&str> {
        md.split(title)
            .nth(1)
            .unwrap_or_else(|| panic!("no {title} in\n{md}"))
            .lines()
            .skip(1)
            .take_while(|l| !l.is_empty())
            .collect()
    };
    assert_eq!(
        table("**Tests** (2 of 2, 1 failed)\n"),
        [
            "| test | calls | bytes | verdict |",
            "|---|---:|---:|---|",
            "| `tests::grows` | 5001 → 10002 (+5001, +100.00%) | 78.1 KiB → 156.3 KiB (+78.1 KiB, +100.00%) | ❌ `calls>+1%`, `bytes>+1%` |",
            "| `tests::steady` | 1001 → 1001 (+0, +0.00%) | 15.6 KiB → 15.6 KiB (+0 B, +0.00%) | ✅ held |",
        ],
        "{md}"
    );
    assert_eq!(
        table("**Groups** (1 of 1)\n"),
        [
            "| group | calls | bytes | verdict |",
            "|---|---:|---:|---|",
            "| `parser` | 4000 → 4600 (+600, +15.00%) | 156.2 KiB → 179.7 KiB (+23.4 KiB, +15.00%) | not gated |",
        ],
        "{md}"
    );
    // Without tests or groups, no such table.
    let plain = markdown(&report(&grown(), &[]));
    assert!(
        !plain.contains("**Tests**") && !plain.contains("**Groups**"),
        "{plain}"
    );
}

/// The XML read back with a strict reader: one test case per condition,
/// the failing one with its regressions.
#[test]
fn junit_is_well_formed_with_a_case_per_condition() {
    use quick_xml::events::Event;
    let d = grown();
    let o = outcomes(&d, &["calls>+5%", "bytes>+1MiB"], false);
    let xml_text = junit(&report(&d, &o));
    let mut reader = quick_xml::Reader::from_str(&xml_text);
    reader.config_mut().check_end_names = true;
    let (mut cases, mut failures) = (Vec::new(), Vec::new());
    loop {
        match reader.read_event().expect("well-formed XML") {
            Event::Start(e) | Event::Empty(e) => {
                let attr = |n: &str| {
                    e.try_get_attribute(n).unwrap().map(|a| {
                        a.normalized_value(quick_xml::XmlVersion::Explicit1_0)
                            .unwrap()
                            .into_owned()
                    })
                };
                match e.name().as_ref() {
                    b"testcase" => cases.push(attr("name").unwrap()),
                    b"failure" => failures.push(attr("message").unwrap()),
                    _ => {}
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    assert_eq!(
        cases,
        ["calls>+5% (totals)", "bytes>+1MiB (totals)"],
        "{xml_text}"
    );
    assert_eq!(failures.len(), 1, "{xml_text}");
    assert!(
        failures[0].starts_with("1 regression: regression: calls>+5%: total calls 4050 -> 4660"),
        "{}",
        failures[0]
    );
    // The escape character cannot be in XML 1.0 at all: said in words.
    assert!(
        xml_text.contains("\\u{1b}") && !xml_text.contains('\u{1b}'),
        "{xml_text}"
    );
}
