//! `--web-config FILE`: TLS and basic authentication for the agent, in the
//! format of the Prometheus exporters' `--web.config.file` (the exporter
//! toolkit's), so that a Prometheus scrape config's `tls_config` and
//! `basic_auth`, or `go tool pprof -tls_ca` with `https://user:pass@...`,
//! reach the agent as they reach node_exporter:
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: agent.crt
//!   key_file: agent.key
//!   client_auth_type: RequireAndVerifyClientCert   # optional
//!   client_ca_file: clients-ca.crt                 # with it
//! basic_auth_users:
//!   prometheus: $2y$10$...                         # bcrypt hash
//! ```
//!
//! Paths are relative to the file's directory. The file and the files it
//! names are looked at again (`stat`) for every connection, and read again
//! when one of them changed: certificates are rotated and users changed
//! without a restart. A file that no longer reads (or, on an address that
//! is not loopback, no longer asks for TLS and authentication) refuses
//! every connection until it is fixed: the agent never falls back to
//! serving in the clear or without the users it was given.
//!
//! Parsed by serde-saphyr: serde_yaml is archived and serde_yml unsound
//! (RUSTSEC-2025-0068); serde-saphyr is maintained, forbids `unsafe` and
//! bounds what a document may cost to parse.

use std::{
    collections::{BTreeMap, HashMap},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
};

use anyhow::Result;
use rustls::{
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    server::WebPkiClientVerifier,
    RootCertStore, ServerConfig,
};
use serde::Deserialize;

use crate::error::{UserError, EXIT_USAGE};

/// The file as written (unknown keys are refused, as the exporter
/// toolkit refuses them).
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFormat {
    #[serde(default)]
    tls_server_config: Option<TlsFormat>,
    #[serde(default)]
    basic_auth_users: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsFormat {
    cert_file: String,
    key_file: String,
    #[serde(default)]
    client_auth_type: Option<String>,
    #[serde(default)]
    client_ca_file: Option<String>,
    #[serde(default)]
    min_version: Option<String>,
    #[serde(default)]
    max_version: Option<String>,
}

/// What one reading of the file asks for.
pub struct Loaded {
    /// TLS, when `tls_server_config` is given.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// User name to bcrypt hash; none: no basic authentication.
    users: BTreeMap<String, String>,
    /// Every client must show a certificate signed by the client CA.
    client_certs: bool,
}

impl Loaded {
    pub fn needs_password(&self) -> bool {
        !self.users.is_empty()
    }

    /// TLS, and every client authenticated (by password or certificate).
    pub fn secured(&self) -> bool {
        self.tls.is_some() && (!self.users.is_empty() || self.client_certs)
    }

    /// How the agent is reached, said at the start.
    pub fn describe(&self) -> String {
        let mut what = Vec::new();
        if self.tls.is_some() {
            what.push("TLS".to_string());
        }
        if self.client_certs {
            what.push("client certificates".to_string());
        }
        if !self.users.is_empty() {
            what.push(format!("basic auth ({} users)", self.users.len()));
        }
        if what.is_empty() {
            "neither TLS nor authentication".into()
        } else {
            what.join(", ")
        }
    }
}

/// A file's identity and last change: a file replaced or rewritten has
/// another.
#[derive(Clone, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

struct State {
    /// The files of the last reading and their stamps before it.
    files: Vec<(PathBuf, Option<Stamp>)>,
    current: std::result::Result<Arc<Loaded>, String>,
}

/// The web configuration file, read again when it or a file it names
/// changes.
pub struct WebConfig {
    path: PathBuf,
    /// The address is not loopback and `--insecure-listen` was not given:
    /// TLS and an authentication are required.
    required: bool,
    state: Mutex<State>,
    /// Passwords checked (bcrypt is slow on purpose): by SHA-256 of user,
    /// password and hash, whether they matched.
    checked: Mutex<HashMap<[u8; 32], bool>>,
}

/// Passwords remembered as checked at most (then forgotten all at once).
const MAX_CHECKED: usize = 1024;

impl WebConfig {
    /// Reads `path`; one that cannot be used is a usage error.
    pub fn load(path: &Path, required: bool) -> Result<WebConfig> {
        let files = vec![(path.to_path_buf(), stamp(path))];
        let (loaded, files) = read(path, required, files).map_err(|why| {
            anyhow::Error::new(UserError::with_code(
                format!("--web-config {}: {why}", path.display()),
                EXIT_USAGE,
            ))
        })?;
        Ok(WebConfig {
            path: path.to_path_buf(),
            required,
            state: Mutex::new(State {
                files,
                current: Ok(Arc::new(loaded)),
            }),
            checked: Mutex::new(HashMap::new()),
        })
    }

    /// What the file asks for now: read again if it or one of its files
    /// changed since the last reading, or why it cannot be used.
    pub fn current(&self) -> std::result::Result<Arc<Loaded>, String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.files.iter().all(|(p, s)| stamp(p) == *s) {
            return st.current.clone();
        }
        let files = vec![(self.path.clone(), stamp(&self.path))];
        match read(&self.path, self.required, files) {
            Ok((loaded, files)) => {
                log::info!("agent: --web-config {} read again", self.path.display());
                st.files = files;
                st.current = Ok(Arc::new(loaded));
                self.checked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clear();
            }
            Err(why) => {
                let why = format!(
                    "--web-config {}: {why}; connections are refused until it is fixed",
                    self.path.display()
                );
                crate::say!("mtrace agent: {why}");
                // Every file stamped as it is now: said once per change.
                st.files = st
                    .files
                    .iter()
                    .map(|(p, _)| (p.clone(), stamp(p)))
                    .chain([(self.path.clone(), stamp(&self.path))])
                    .collect();
                st.current = Err(why);
            }
        }
        st.current.clone()
    }

    /// Whether `authorization` (the request's header) names a user of
    /// `loaded` with its password, when that was checked before.
    pub fn remembered(&self, loaded: &Loaded, authorization: Option<&str>) -> Option<bool> {
        let (user, password) = match credentials(authorization) {
            Some(c) => c,
            None => return Some(false),
        };
        let key = check_key(&user, &password, loaded.users.get(&user));
        self.checked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .copied()
    }

    /// Whether `authorization` names a user of `loaded` with its password:
    /// bcrypt, tens of milliseconds of CPU (run it on a blocking thread).
    /// An unknown user costs the same as a known one.
    pub fn check(&self, loaded: &Loaded, authorization: Option<&str>) -> bool {
        let Some((user, password)) = credentials(authorization) else {
            return false;
        };
        let hash = loaded.users.get(&user);
        let key = check_key(&user, &password, hash);
        let ok = match hash {
            Some(h) => bcrypt::verify(&password, h).unwrap_or(false),
            None => {
                let _ = bcrypt::verify(&password, unknown_user_hash());
                false
            }
        };
        let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
        if checked.len() >= MAX_CHECKED {
            checked.clear();
        }
        checked.insert(key, ok);
        ok
    }
}

/// A hash no password is checked against but an unknown user's.
fn unknown_user_hash() -> &'static str {
    static HASH: OnceLock<String> = OnceLock::new();
    HASH.get_or_init(|| {
        bcrypt::hash("mtrace: no such user", bcrypt::DEFAULT_COST).unwrap_or_default()
    })
}

fn check_key(user: &str, password: &str, hash: Option<&String>) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for part in [user, password, hash.map_or("", String::as_str)] {
        ctx.update(&(part.len() as u64).to_le_bytes());
        ctx.update(part.as_bytes());
    }
    let mut key = [0u8; 32];
    key.copy_from_slice(ctx.finish().as_ref());
    key
}

/// `Basic base64(user:password)`, decoded.
fn credentials(authorization: Option<&str>) -> Option<(String, String)> {
    use base64::Engine as _;
    let value = authorization?.trim();
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

type Files = Vec<(PathBuf, Option<Stamp>)>;

/// Reads the file at `path` (its stamp already in `files`) and the files
/// it names, each stamped before it is read.
fn read(
    path: &Path,
    required: bool,
    mut files: Files,
) -> std::result::Result<(Loaded, Files), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let format: FileFormat = if text
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        FileFormat::default()
    } else {
        serde_saphyr::from_str(&text).map_err(|e| one_line(&e.to_string()))?
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    for (user, hash) in &format.basic_auth_users {
        hash.parse::<bcrypt::HashParts>()
            .map_err(|e| format!("basic_auth_users: {user}'s hash: {e}"))?;
    }
    let (tls, client_certs) = match &format.tls_server_config {
        None => (None, false),
        Some(t) => {
            let (config, client_certs) = tls_config(t, dir, &mut files)?;
            (
                Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
                client_certs,
            )
        }
    };
    let loaded = Loaded {
        tls,
        users: format.basic_auth_users,
        client_certs,
    };
    if required && !loaded.secured() {
        return Err(
            "an address that is not loopback needs TLS (tls_server_config) and an authentication (basic_auth_users, or client_auth_type: RequireAndVerifyClientCert); --insecure-listen serves it without"
                .into(),
        );
    }
    Ok((loaded, files))
}

/// An error message on one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `tls_server_config` as rustls' server configuration (ring's
/// cryptography), and whether it requires verified client certificates.
fn tls_config(
    t: &TlsFormat,
    dir: &Path,
    files: &mut Files,
) -> std::result::Result<(ServerConfig, bool), String> {
    let mut named = |p: &str| {
        let path = dir.join(p);
        files.push((path.clone(), stamp(&path)));
        path
    };
    let cert_file = named(&t.cert_file);
    let key_file = named(&t.key_file);
    let ca_file = t.client_ca_file.as_deref().map(&mut named);
    let chain = CertificateDer::pem_file_iter(&cert_file)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| format!("cert_file {}: {e}", cert_file.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "cert_file {}: no certificate in it",
            cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&key_file)
        .map_err(|e| format!("key_file {}: {e}", key_file.display()))?;

    let version = |v: &Option<String>, default| match v.as_deref().unwrap_or(default) {
        "TLS12" => Ok(0),
        "TLS13" => Ok(1),
        other => Err(format!(
            "TLS version {other}: TLS12 or TLS13 (rustls has no earlier one)"
        )),
    };
    let (min, max) = (
        version(&t.min_version, "TLS12")?,
        version(&t.max_version, "TLS13")?,
    );
    if max < min {
        return Err("max_version is below min_version".into());
    }
    let versions: Vec<&'static rustls::SupportedProtocolVersion> =
        [&rustls::version::TLS12, &rustls::version::TLS13][min..=max].to_vec();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&versions)
        .map_err(|e| e.to_string())?;

    let auth = t.client_auth_type.as_deref().unwrap_or("NoClientCert");
    let roots = |ca: Option<&PathBuf>| -> std::result::Result<Arc<RootCertStore>, String> {
        let ca = ca.ok_or_else(|| format!("client_auth_type {auth} needs client_ca_file"))?;
        let mut roots = RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(ca)
            .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| format!("client_ca_file {}: {e}", ca.display()))?;
        for c in certs {
            roots
                .add(c)
                .map_err(|e| format!("client_ca_file {}: {e}", ca.display()))?;
        }
        Ok(Arc::new(roots))
    };
    let (builder, client_certs) = match auth {
        "NoClientCert" => {
            if ca_file.is_some() {
                return Err(
                    "client_ca_file is given but client_auth_type is NoClientCert: say RequireAndVerifyClientCert or VerifyClientCertIfGiven"
                        .into(),
                );
            }
            (builder.with_no_client_auth(), false)
        }
        "RequireAndVerifyClientCert" | "VerifyClientCertIfGiven" => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(roots(ca_file.as_ref())?, provider);
            let required = auth == "RequireAndVerifyClientCert";
            let verifier = if required {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier.build().map_err(|e| e.to_string())?;
            (builder.with_client_cert_verifier(verifier), required)
        }
        "RequestClientCert" | "RequireAnyClientCert" => {
            return Err(format!(
                "client_auth_type {auth}: a client certificate is only taken verified here (RequireAndVerifyClientCert, VerifyClientCertIfGiven)"
            ))
        }
        other => return Err(format!("client_auth_type {other}: NoClientCert, RequireAndVerifyClientCert or VerifyClientCertIfGiven")),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| format!("cert_file and key_file: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((config, client_certs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_credentials_are_decoded() {
        // "prom:se:cret"
        assert_eq!(
            credentials(Some("Basic cHJvbTpzZTpjcmV0")),
            Some(("prom".into(), "se:cret".into()))
        );
        assert_eq!(credentials(Some("Bearer cHJvbTpzZWNyZXQ=")), None);
        assert_eq!(credentials(Some("Basic !!!")), None);
        assert_eq!(credentials(None), None);
    }

    #[test]
    fn unknown_keys_and_bad_hashes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("web.yml");
        std::fs::write(&path, "basic_auth_users:\n  a: notahash\n").unwrap();
        let e = read(&path, false, Vec::new()).err().unwrap();
        assert!(e.contains("a's hash"), "{e}");
        std::fs::write(&path, "tls_server_config:\n  cipher_suites: []\n").unwrap();
        let e = read(&path, false, Vec::new()).err().unwrap();
        assert!(e.contains("cipher_suites"), "{e}");
        std::fs::write(&path, "# nothing\n").unwrap();
        assert!(read(&path, false, Vec::new()).is_ok());
        let e = read(&path, true, Vec::new()).err().unwrap();
        assert!(e.contains("--insecure-listen"), "{e}");
    }
}
