//! Prometheus (Debian's) scraping the agent, and its query API; the
//! agent's own metric lines.

use std::{
    net::TcpStream,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use super::{
    http::{free_port, http},
    process::Proc,
};

/// A metric line's value (`name{labels} value`), the labels given as
/// they are written.
pub(crate) fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Prometheus scraping one job, `mtrace`, every second, configured by
/// `job` (its lines after `job_name`, indented by four); ready to answer
/// queries, and the address of its API.
pub(crate) fn start_prometheus(dir: &Path, job: &str) -> (Proc, String) {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: mtrace\n    {job}"
        ),
    )
    .unwrap();
    let prom_addr = format!("127.0.0.1:{}", free_port());
    let mut prom = Proc::spawn(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={prom_addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
        "prometheus",
    );
    // Listening comes before ready (its storage opening): the query API
    // answers 503 until /-/ready says 200.
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(&prom_addr).is_err() || http(&prom_addr, "GET", "/-/ready").0 != 200 {
        assert!(prom.running(), "prometheus exited");
        assert!(
            Instant::now() < deadline,
            "prometheus never became ready on {prom_addr}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (prom, prom_addr)
}

/// `GET /api/v1/query?query=Q` of Prometheus: the first result's value.
pub(crate) fn prom_query(addr: &str, query: &str) -> Option<f64> {
    let mut q = String::new();
    for b in query.bytes() {
        if b.is_ascii_alphanumeric() || b"_-.".contains(&b) {
            q.push(b as char);
        } else {
            q.push_str(&format!("%{b:02X}"));
        }
    }
    let (code, body) = http(addr, "GET", &format!("/api/v1/query?query={q}"));
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let value = v["data"]["result"].get(0)?["value"][1]
        .as_str()?
        .to_string();
    value.parse().ok()
}

/// Polls `query` until `ok` holds of its value; the last value seen.
pub(crate) fn prom_until(
    addr: &str,
    query: &str,
    within: Duration,
    ok: impl Fn(f64) -> bool,
) -> Option<f64> {
    let deadline = Instant::now() + within;
    loop {
        let v = prom_query(addr, query);
        if v.is_some_and(&ok) || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}
