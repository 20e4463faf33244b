//! A plain HTTP/1.0 client, enough for the agent's and Prometheus's
//! endpoints.

use std::{
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};

/// One HTTP/1.0 request: the status and the body (as text).
pub(crate) fn http(addr: &str, method: &str, path: &str) -> (u16, String) {
    try_http(addr, method, path).unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"))
}

/// [`http`], or what went wrong.
pub(crate) fn try_http(addr: &str, method: &str, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connecting: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")
        .map_err(|e| format!("writing: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("reading: {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP head in {text:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    Ok((code, body.to_string()))
}

/// A port free now on loopback.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
