//! The HTML report (`--html`, `mtrace report --html`) opened in headless
//! Chromium: no console message, the stacks' names in the DOM after the
//! page's script ran, the flame graphs and the plots there, nothing loaded
//! from elsewhere (every host name fails to resolve, and every `src` and
//! `href` is checked), and a screenshot for a person to look at.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use base64::Engine as _;
use serde_json::json;

use crate::support::{live::run_live, mtrace::report, require, s};

const CHROMIUM: &str = "/usr/bin/chromium";

/// Where the screenshots go: target/tmp/html-report/.
fn shots_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("html-report");
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// What Chromium did with a page.
struct Opened {
    stdout: String,
    /// The console's messages.
    console: Vec<String>,
    /// The URLs the page (not the browser itself) asked the network for.
    requests: Vec<String>,
}

impl Opened {
    /// No console message, no request to the network.
    fn assert_clean(&self) {
        assert!(
            self.console.is_empty(),
            "console messages:\n{}",
            self.console.join("\n")
        );
        assert!(
            self.requests.is_empty(),
            "the page loaded {:?}",
            self.requests
        );
    }
}

/// Headless Chromium on `page` (a path, maybe with a `#fragment`) with
/// `what` (`--dump-dom`, `--screenshot=...`), no network: every host name
/// fails to resolve, and the network log says what was asked for.
fn chromium(page: &Path, what: &str) -> Opened {
    let dir = tempfile::tempdir().unwrap();
    let netlog = dir.path().join("netlog.json");
    let out = Command::new("timeout")
        .args([
            "120",
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
        ])
        .args([
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1400,3200",
        ])
        .args([
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--proxy-server=127.0.0.1:9",
        ])
        .arg(format!("--log-net-log={}", s(&netlog)))
        .arg(format!(
            "--user-data-dir={}",
            s(&dir.path().join("profile"))
        ))
        .args(["--virtual-time-budget=5000", what])
        .arg(format!("file://{}", s(page)))
        .output()
        .expect("cannot run chromium");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "chromium failed: {}\n{stderr}",
        out.status
    );
    let console = stderr
        .lines()
        .filter(|l| l.contains(":CONSOLE"))
        .map(str::to_string)
        .collect();
    // The browser's own requests (updates, accounts) have no origin; the
    // page's have its own (`null` for a file).
    let log: serde_json::Value =
        serde_json::from_slice(&fs::read(&netlog).expect("no network log"))
            .expect("the network log is not JSON");
    let mut requests: Vec<String> = log["events"]
        .as_array()
        .expect("no events in the network log")
        .iter()
        .map(|e| &e["params"])
        .filter(|p| p["initiator"].is_string() && p["initiator"] != "not an origin")
        .filter_map(|p| Some(p["url"].as_str()?.to_string()))
        .collect();
    requests.sort();
    requests.dedup();
    Opened {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        console,
        requests,
    }
}

/// Whether Chromium is there (under CI, its absence fails the test).
fn have_chromium() -> bool {
    require(
        Path::new(CHROMIUM).exists(),
        "the HTML tests need chromium (cargo xtask setup installs it)",
    )
}

/// `s` as it reads in HTML text.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The page's flame graphs: (weight, SVG) from their `data:` URLs.
fn flame_graphs(dom: &str) -> Vec<(String, String)> {
    dom.split("<iframe ")
        .skip(1)
        .map(|tag| {
            let attr = |name: &str| {
                let at = tag
                    .find(&format!("{name}=\""))
                    .unwrap_or_else(|| panic!("no {name}: {tag:.200}"));
                tag[at + name.len() + 2..]
                    .split('"')
                    .next()
                    .unwrap()
                    .to_string()
            };
            let src = attr("src");
            let b64 = src
                .strip_prefix("data:image/svg+xml;base64,")
                .unwrap_or_else(|| panic!("not an SVG data: URL: {src:.80}"));
            let svg = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap();
            (attr("data-weight"), String::from_utf8(svg).unwrap())
        })
        .collect()
}

/// Every `src`, `href` and `url(` of `text` is of the page itself.
fn assert_nothing_external(text: &str, what: &str) {
    for attr in ["src=\"", "href=\"", "url("] {
        for value in text.split(attr).skip(1) {
            let value = &value[..value.len().min(60)];
            assert!(
                value.starts_with("data:") || value.starts_with('#'),
                "{what} loads {attr}{value}"
            );
        }
    }
}

/// What every page must show, checked in the DOM Chromium built: returns
/// the flame graphs. Also takes the screenshot `shot`.
fn check_page(page: &Path, shot: &str, names: &[&str]) -> (String, Vec<(String, String)>) {
    let opened = chromium(page, "--dump-dom");
    opened.assert_clean();
    let dom = opened.stdout;
    assert!(
        dom.contains("</footer>"),
        "the DOM is not the page:\n{dom:.2000}"
    );
    for name in names {
        assert!(dom.contains(&esc(name)), "{name} is not in the DOM");
    }
    assert_nothing_external(&dom, "the page");
    let flames = flame_graphs(&dom);
    for (weight, svg) in &flames {
        assert!(
            svg.starts_with("<?xml") && svg.contains("</svg>"),
            "{weight}"
        );
        assert_nothing_external(svg, weight);
    }
    let plots = dom.matches("<figure class=\"plot\"><svg").count();
    assert!(plots >= 2, "{plots} plots");

    let png = shots_dir().join(shot);
    let _ = fs::remove_file(&png);
    chromium(page, &format!("--screenshot={}", s(&png))).assert_clean();
    let bytes = fs::read(&png).expect("no screenshot");
    assert!(bytes.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
    eprintln!("screenshot of the HTML report: {}", png.display());
    (dom, flames)
}

/// What the checks catch: a page that logs an error and loads a script
/// and an image from elsewhere.
#[test]
fn chromium_reports_console_messages_and_loads() {
    if !have_chromium() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("bad.html");
    fs::write(
        &page,
        "<!DOCTYPE html><html><head><link rel=\"icon\" href=\"data:,\"></head><body>\
         <img src=\"https://example.com/x.png\"><script src=\"http://example.org/a.js\"></script>\
         <script>console.error('boom')</script></body></html>",
    )
    .unwrap();
    let opened = chromium(&page, "--dump-dom");
    assert!(
        opened.console.iter().any(|l| l.contains("\"boom\"")),
        "{:?}",
        opened.console
    );
    assert_eq!(
        opened.requests,
        ["http://example.org/a.js", "https://example.com/x.png"]
    );
}

#[test]
fn live_trace_writes_an_html_report() {
    need_bpf!();
    if !have_chromium() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("live.html");
    let (p, out) = run_live(&["--html", s(&page)]);
    let wrote = format!("mtrace: wrote HTML report to {}", page.display());
    assert!(out.stderr.contains(&wrote), "{}", out.describe());
    // The stack of the most calls: churn_site's 10000 mallocs.
    let top = p.allocs().max_by_key(|st| st.calls).unwrap();
    assert_eq!(top.caller(), Some("churn_site"));
    let names = top.names();
    let (dom, flames) = check_page(&page, "live.png", &names);
    let weights: Vec<&str> = flames.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(weights, ["calls", "bytes", "inuse", "leaked"]);
    let graph = |w: &str| &flames.iter().find(|f| f.0 == w).unwrap().1;
    // By calls, churn_site is most of the graph; by bytes, the huge
    // malloc that failed (its bytes were requested) dwarfs every other.
    assert!(graph("calls").contains("churn_site") && graph("calls").contains("leak_site"));
    assert!(graph("bytes").contains("failing_allocs"));
    // In use and leaked (no --min-age): leak_site's blocks and grow_site's
    // buffer, nothing of churn_site.
    for w in ["inuse", "leaked"] {
        let svg = graph(w);
        assert!(
            svg.contains("leak_site") && svg.contains("grow_site"),
            "{w}"
        );
        assert!(
            !svg.contains("churn_site") && !svg.contains("producer"),
            "{w}"
        );
    }
    // Chosen by a link, the leaked bytes' graph is shown and loaded, the
    // calls' one hidden; the table sorted by bytes (the click handler of
    // its header ran).
    let leaked = page.with_file_name("live.html#weight=leaked&sort=bytes");
    let opened = chromium(&leaked, "--dump-dom");
    opened.assert_clean();
    let dom_leaked = opened.stdout;
    let tag = |w: &str| {
        let at = dom_leaked.find(&format!("data-weight=\"{w}\"")).unwrap();
        let start = dom_leaked[..at].rfind('<').unwrap();
        dom_leaked[start..start + dom_leaked[start..].find('>').unwrap()].to_string()
    };
    assert!(
        tag("leaked").contains(" src=\"data:") && !tag("leaked").contains("hidden"),
        "{:.300}",
        tag("leaked")
    );
    assert!(tag("calls").contains("hidden"), "{:.300}", tag("calls"));
    let callers = |dom: &str| -> Vec<String> {
        let table = &dom[dom.find("<table class=\"sortable stacks\"").unwrap()..];
        let table = &table[..table.find("</table>").unwrap()];
        table
            .split("<summary>")
            .skip(1)
            .map(|s| s.split([' ', '<']).next().unwrap().to_string())
            .collect()
    };
    // By calls: churn_site's 10000 first; by bytes: the failed huge malloc,
    // then grow_site's 8 MB of reallocs.
    assert_eq!(callers(&dom)[..2], ["churn_site", "grow_site"]);
    assert_eq!(
        callers(&dom_leaked)[..3],
        ["failing_allocs", "grow_site", "churn_site"]
    );
    assert!(dom_leaked.contains("<th class=\"num\" aria-sort=\"descending\">bytes</th>"));
    let png = shots_dir().join("live-leaked.png");
    let _ = fs::remove_file(&png);
    chromium(&leaked, &format!("--screenshot={}", s(&png))).assert_clean();
    assert!(fs::read(&png)
        .expect("no screenshot")
        .starts_with(b"\x89PNG"));
    eprintln!(
        "screenshot of the leaked bytes' flame graph: {}",
        png.display()
    );
    // The leak suspects: leak_site's 100 blocks of 64 bytes.
    let leaks = &dom[dom.find("<section id=\"leaks\"").expect("no leak suspects")..];
    let row = &leaks[leaks.find("leak_site").unwrap().saturating_sub(600)..];
    assert!(
        row.contains("<td data-v=\"100\">100</td><td data-v=\"6400\">6.2 KiB</td>"),
        "{row:.700}"
    );
    for title in ["Requested size per stack", "Lifetime of freed blocks"] {
        assert!(dom.contains(title), "no plot {title}");
    }
    if let Some(timeline) = p.doc.get("timeline") {
        // Live mode counts frees: they are plotted with the calls.
        let with_frees = timeline["points"][0].get("frees").is_some();
        let rates = if with_frees {
            "Allocation calls and frees per second"
        } else {
            "Allocation calls per second"
        };
        for title in [rates, "Bytes requested per second", "Live heap"] {
            assert!(dom.contains(title), "no plot {title}");
        }
    } else {
        assert!(dom.contains("This profile has no timeline"));
    }
}

/// A count-mode profile written by hand, with a timeline.
fn count_profile() -> serde_json::Value {
    let frame = |f: &str, line: u32| json!({"function": f, "file": "app.c", "line": line, "module": "/opt/app", "address": 4096 + line, "inlined": false});
    let stack = |func: &str, frames: Vec<serde_json::Value>, calls: u64, bytes: u64| json!({"function": func, "frames": frames, "truncated": false, "thread": null, "calls": calls, "bytes": bytes});
    let points: Vec<_> = (1..=10)
        .map(|i| json!({"t": i as f64 * 0.5, "calls": 100 * i, "bytes": 4000 * i}))
        .collect();
    json!({
        "format": "mtrace-profile",
        "schema_version": 1,
        "meta": {
            "mtrace_version": "0.1.0", "pid": 4242, "command": "./app <input>",
            "start_time": "2026-11-24T18:00:00Z", "duration_secs": 5.0,
            "kernel_release": "6.1.0", "mode": "count",
            "allocator_object": "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "probes": [{"function": "malloc", "offset": 0, "instruction": "endbr64", "emulated": true}]
        },
        "stacks": [
            stack("malloc", vec![frame("parse_record", 10), frame("main", 50)], 5000, 200000),
            stack("calloc", vec![frame("make_table", 20), frame("main", 51)], 500, 64000),
        ],
        "totals": {
            "per_func": {"malloc": {"calls": 5000, "bytes": 200000}, "calloc": {"calls": 500, "bytes": 64000}},
            "allocs": {"calls": 5500, "bytes": 264000}, "frees": 0, "frees_counted": false, "nested": 0
        },
        "losses": {
            "map_full": 0, "stack_walk_failed": 0, "stack_collisions": 0,
            "stack_map_full": 7, "caller_unreadable": 0, "thread_names_full": 0
        },
        "timeline": {"interval_secs": 0.5, "points": points}
    })
}

#[test]
fn report_renders_a_saved_profile_as_html() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("app.json");
    fs::write(
        &json,
        serde_json::to_string_pretty(&count_profile()).unwrap(),
    )
    .unwrap();
    crate::support::validate_profile(&json);
    let page = dir.path().join("app.html");
    let out = report(&[s(&json), "--html", s(&page)]);
    let wrote = format!("mtrace: wrote HTML report to {}", page.display());
    assert!(out.stderr.contains(&wrote), "{}", out.describe());
    // The page as written (the script changes nothing without a link's
    // choice), then as Chromium shows it.
    let dom = fs::read_to_string(&page).unwrap();
    // Every loss counter is shown, the one that lost something marked.
    for loss in [
        "map full",
        "stack walk failed",
        "stack collisions",
        "caller unreadable",
        "thread names full",
    ] {
        assert!(
            dom.contains(&format!("<th>{loss}</th><td>0</td>")),
            "{loss}"
        );
    }
    assert!(dom.contains("<th>stack map full</th><td><b class=\"lost\">7</b></td>"));
    // Rates over time: the timeline's 10 points (100 i calls in the i-th
    // half second: 200 i calls/s), from the start of the trace.
    assert!(dom.contains("Bytes requested per second"));
    let chart = &dom[dom
        .find("Allocation calls per second")
        .expect("no rate plot")..];
    let chart = &chart[..chart.find("</figure>").unwrap()];
    let line = chart
        .split("stroke=\"#1F6FB4\" stroke-width=\"2\" points=\"")
        .nth(1)
        .expect("no line in the rate plot");
    let heights: Vec<i64> = line[..line.find('"').unwrap()]
        .split_whitespace()
        .map(|xy| xy.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(heights.len(), 11, "{heights:?}");
    assert_eq!(heights[0], heights[1], "{heights:?}");
    assert!(
        heights[1..].windows(2).all(|w| w[1] < w[0]),
        "not rising: {heights:?}"
    );
    assert!(!dom.contains("Live heap"));
    assert!(!dom.contains("id=\"leaks\""));
    // The table's rows: most calls first.
    let first = dom.find("parse_record").unwrap();
    let second = dom.find("make_table").unwrap();
    assert!(first < second);
    if !have_chromium() {
        return;
    }
    let (_, flames) = check_page(
        &page,
        "report.png",
        &["parse_record", "main", "make_table", "./app <input>"],
    );
    let weights: Vec<&str> = flames.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(weights, ["calls", "bytes"]);
    assert!(flames[0].1.contains("parse_record") && flames[0].1.contains("make_table"));
}

/// Names holding ESC, BEL and CR (a frame's, the command's) reach the page
/// and its flame graphs as their escapes, as the table writes them: the
/// page as written holds no raw control character a terminal (`cat`,
/// `less -r`) or a tool would act on.
#[test]
fn control_characters_of_names_are_escaped_in_the_page() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("app.json");
    let mut profile = count_profile();
    let crafted = "parse\u{1b}]0 owned\u{7}\u{1b}[2J\rrecord";
    profile["stacks"][0]["frames"][0]["function"] = json!(crafted);
    profile["meta"]["command"] = json!("./app\u{1b}[31m\r");
    fs::write(&json, serde_json::to_string(&profile).unwrap()).unwrap();
    let page = dir.path().join("app.html");
    report(&[s(&json), "--html", s(&page)]);
    let dom = fs::read_to_string(&page).unwrap();
    let flames = flame_graphs(&dom);
    assert_eq!(flames.len(), 2);
    for (what, text) in
        std::iter::once(("the page", &dom)).chain(flames.iter().map(|f| ("a flame graph", &f.1)))
    {
        for c in ['\u{1b}', '\u{7}', '\r'] {
            assert!(!text.contains(c), "{what} holds {c:?}");
        }
        assert!(
            text.contains("parse\\u{1b}]0 owned\\u{7}\\u{1b}[2J\\u{d}record"),
            "{what} lacks the escaped name"
        );
    }
    assert!(dom.contains("./app\\u{1b}[31m\\u{d}"), "no escaped command");
}
