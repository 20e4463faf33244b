//! The agent beyond loopback: `--web-config` (the Prometheus exporters'
//! web configuration file) gives it TLS and basic auth, which a real
//! Prometheus (`tls_config`, `basic_auth`) and `go tool pprof`
//! (`-tls_ca`, `https://user:password@...`) use; a changed file is read
//! again for the next connection; an address that is not loopback is
//! refused without them unless `--insecure-listen` says otherwise.

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::support::{
    self,
    agent::{agent_fixture, tell, Agent},
    have,
    mtrace::run_mtrace,
    pprof::{at_site, pprof_fetch, pprof_raw_env},
    process::FixtureProc,
    prometheus::{prom_until, start_prometheus},
};

/// A test CA, a server certificate of it for 127.0.0.1 and localhost, and
/// a client certificate of it, as PEM files in `dir`.
struct Certs {
    ca: PathBuf,
    server: (PathBuf, PathBuf),
    client: (PathBuf, PathBuf),
}

fn certs(dir: &Path) -> Certs {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "mtrace e2e CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let issue = |name: &str, names: &[&str]| {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        let cert = params.signed_by(&key, &ca).unwrap();
        (
            write(&format!("{name}.crt"), &cert.pem()),
            write(&format!("{name}.key"), &key.serialize_pem()),
        )
    };
    let server = issue("server", &["127.0.0.1", "localhost"]);
    let client = issue("client", &["prometheus"]);
    Certs {
        ca: write("ca.crt", &ca.pem()),
        server,
        client,
    }
}

/// A web configuration: the server's certificate, basic auth for `prom`
/// with password `secret`, and `extra` lines under `tls_server_config`.
fn web_config(certs: &Certs, extra: &str) -> String {
    let hash = bcrypt::hash("secret", 4).unwrap();
    format!(
        "tls_server_config:\n  cert_file: {}\n  key_file: {}\n{extra}basic_auth_users:\n  prom: {hash}\n",
        certs.server.0.display(),
        certs.server.1.display()
    )
}

/// On every address (`0.0.0.0`, not loopback), with TLS and basic auth:
/// `go tool pprof` reads the exact counts over HTTPS with the user's
/// password and is refused without it or with another; Prometheus
/// scrapes the exact count; plain HTTP gets no answer. Then the file is
/// changed to ask for client certificates too: the next connection
/// without one is refused, with one it is served.
#[test]
fn prometheus_and_go_tool_pprof_read_the_agent_over_tls_with_basic_auth() {
    if !support::require_bpf()
        || !support::require(have("go"), "go (Debian's golang-go) is not installed")
        || !support::require(
            have("prometheus"),
            "prometheus (Debian's prometheus) is not installed",
        )
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path());
    let config = dir.path().join("web.yml");
    std::fs::write(&config, web_config(&certs, "")).unwrap();
    let mut fx = FixtureProc::start(agent_fixture(), &[]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let agent = Agent::start_on(
        "0.0.0.0:0",
        &[
            "--web-config",
            config.to_str().unwrap(),
            "--policy",
            "always",
            "--pid",
            &pid,
        ],
    );
    tell(&mut fx, "a 1234");

    // Plain HTTP is not answered.
    let mut plain = TcpStream::connect(&agent.addr).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(plain, "GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    let _ = plain.read_to_end(&mut raw);
    assert!(
        !raw.starts_with(b"HTTP/"),
        "plain HTTP answered: {:?}",
        String::from_utf8_lossy(&raw)
    );

    // Go 1.19's `go tool pprof` fetches http(s) URLs itself, with the
    // system's roots (its -tls_* flags are the standalone pprof's): Go
    // takes the CA from SSL_CERT_FILE.
    let url = |user: &str| format!("https://{user}@{}/debug/pprof/allocs", agent.addr);
    let ca: &Path = &certs.ca;
    let trust = [("SSL_CERT_FILE", ca)];
    let (_, samples) = pprof_raw_env(dir.path(), &url("prom:secret"), &[], &trust);
    assert_eq!(at_site(&samples, "agent_site_a"), [1234, 1_234_000]);
    for user in ["prom:wrong", "nobody:secret"] {
        let out = pprof_fetch(dir.path(), &url(user), &[], &trust);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("401"),
            "{user}: {}\n{err}",
            out.status
        );
    }
    let bare = format!("https://{}/debug/pprof/allocs", agent.addr);
    let out = pprof_fetch(dir.path(), &bare, &[], &trust);
    assert!(!out.status.success(), "served without a password");

    // Prometheus with the CA, the user's password and a client
    // certificate (shown when the agent asks for one).
    let job = format!(
        "scheme: https\n    tls_config:\n      ca_file: {}\n      cert_file: {}\n      key_file: {}\n    basic_auth:\n      username: prom\n      password: secret\n    static_configs:\n      - targets: ['{}']\n",
        certs.ca.display(),
        certs.client.0.display(),
        certs.client.1.display(),
        agent.addr
    );
    let (mut prom, prom_addr) = start_prometheus(dir.path(), &job);
    let series = format!("mtrace_allocation_calls_total{{pid=\"{pid}\",function=\"malloc\"}}");
    let total = prom_until(&prom_addr, &series, Duration::from_secs(30), |v| {
        v == 1234.0
    });
    assert_eq!(total, Some(1234.0), "Prometheus over TLS with basic auth");

    // Client certificates asked for from the next connection on: pprof,
    // which has none to show, is refused; Prometheus scrapes on.
    std::fs::write(
        &config,
        web_config(
            &certs,
            &format!(
                "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {}\n",
                certs.ca.display()
            ),
        ),
    )
    .unwrap();
    let out = pprof_fetch(dir.path(), &url("prom:secret"), &[], &trust);
    assert!(!out.status.success(), "served without a client certificate");
    tell(&mut fx, "a 100");
    let total = prom_until(&prom_addr, &series, Duration::from_secs(30), |v| {
        v == 1334.0
    });
    assert_eq!(total, Some(1334.0), "Prometheus with a client certificate");
    prom.signal(libc::SIGTERM);

    drop(fx.stdin.take());
    agent.mtrace.finish().assert_exit(0);
}

/// An address that is not loopback is refused (one line, exit 2) without
/// a web configuration of TLS and an authentication, and served without
/// them only with `--insecure-listen`, which the agent says.
#[test]
fn a_non_loopback_address_needs_tls_and_auth_or_insecure_listen() {
    need_bpf!();
    let me = std::process::id().to_string();
    let out = run_mtrace(&["agent", "--listen", "0.0.0.0:0", "--pid", &me]);
    out.assert_exit(2);
    out.assert_error("--listen 0.0.0.0:0 is not loopback");
    let dir = tempfile::tempdir().unwrap();
    let certs = certs(dir.path());
    let config = dir.path().join("web.yml");
    for (text, why) in [
        (
            format!(
                "tls_server_config:\n  cert_file: {}\n  key_file: {}\n",
                certs.server.0.display(),
                certs.server.1.display()
            ),
            "needs TLS (tls_server_config) and an authentication",
        ),
        (
            format!(
                "basic_auth_users:\n  prom: {}\n",
                bcrypt::hash("x", 4).unwrap()
            ),
            "needs TLS (tls_server_config) and an authentication",
        ),
        ("basic_auth_users:\n  prom: plain\n".into(), "prom's hash"),
        ("tls_config:\n  cert_file: x\n".into(), "tls_config"),
        (
            "tls_server_config:\n  cert_file: nothere.crt\n  key_file: nothere.key\n".into(),
            "nothere.crt",
        ),
    ] {
        std::fs::write(&config, text).unwrap();
        let out = run_mtrace(&[
            "agent",
            "--listen",
            "0.0.0.0:0",
            "--web-config",
            config.to_str().unwrap(),
            "--pid",
            &me,
        ]);
        out.assert_exit(2);
        out.assert_error(why);
    }

    let mut fx = FixtureProc::start(agent_fixture(), &[]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let agent = Agent::start_on("0.0.0.0:0", &["--insecure-listen", "--pid", &pid]);
    assert!(
        agent.line.contains("NOT loopback") && agent.line.contains("any host"),
        "{}",
        agent.line
    );
    assert_eq!(agent.get("/healthz").0, 200);
    drop(fx.stdin.take());
    agent.mtrace.finish().assert_exit(0);
}
