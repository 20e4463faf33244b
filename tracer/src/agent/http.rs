//! The agent's HTTP endpoints: GET and HEAD only, nothing that writes.
//!
//! Connections are tokio tasks on a thread of their own (an idle one
//! costs a few KiB, not a thread); a request's head is parsed by
//! `httparse`; each request is answered on a blocking thread, so that a
//! `?seconds=60` profile does not hold up a scrape of `/metrics`. Every
//! answer closes its connection. Written here rather than taken whole
//! from a crate: tiny_http (used before) gives every connection a thread
//! for as long as the client keeps it open and has neither a limit nor a
//! timeout, so a local client that opened connections and sent nothing
//! made the agent's threads grow without bound; hyper would bring a
//! server framework for four GET routes.
//!
//! Bounds: at most [`MAX_CONNECTIONS`] open (when full, the one that has
//! waited longest for its request head is closed for the new one, so idle
//! connections cannot lock a scraper out), a head within [`HEAD_TIMEOUT`]
//! and [`MAX_HEAD`] bytes, at most [`MAX_IN_FLIGHT`] requests answered at
//! once (more get 503).

use std::{
    collections::VecDeque,
    net::{SocketAddr, TcpListener},
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{metrics, Reading, Shared};
use crate::{profile::Profile, render::pprof};

/// Requests answered side by side at most.
const MAX_IN_FLIGHT: usize = 16;

/// Connections open at once at most.
const MAX_CONNECTIONS: usize = 64;

/// How long a connection may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest request head read (431 beyond).
const MAX_HEAD: usize = 16 * 1024;

/// How long an answer may take to be written (a client that reads
/// nothing is dropped).
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest `?seconds=` window.
const MAX_SECONDS: u64 = 3600;

/// The listening socket, bound before anything is attached (a port in
/// use is a usage error, not a trace lost), then served.
pub struct Server {
    listener: Option<TcpListener>,
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    pub fn bind(addr: SocketAddr) -> Result<Server> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| crate::user_error!("cannot listen on {addr}: {e}"))?;
        let addr = listener.local_addr()?;
        Ok(Server {
            listener: Some(listener),
            addr,
            stop: None,
            thread: None,
        })
    }

    /// Answers requests from `shared`'s readings, on a thread, until
    /// [`Server::stop`].
    pub fn serve(&mut self, shared: Arc<Shared>) -> Result<()> {
        let listener = self.listener.take().context("the agent serves once")?;
        listener.set_nonblocking(true)?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("the agent's HTTP runtime")?;
        let thread = std::thread::Builder::new()
            .name("mtrace-agent-http".into())
            .spawn(move || {
                runtime.block_on(accept(listener, shared, stopped));
                // Answers under way finish on their threads, unwaited.
                runtime.shutdown_background();
            })
            .context("starting the agent's HTTP thread")?;
        self.stop = Some(stop);
        self.thread = Some(thread);
        Ok(())
    }

    /// Stops accepting; requests under way finish on their own threads.
    pub fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connections still waiting for their request head, oldest first: the
/// first to close when the connections are at their limit.
#[derive(Default)]
struct Waiting {
    next: AtomicU64,
    open: AtomicUsize,
    heads: Mutex<VecDeque<(u64, tokio::task::AbortHandle)>>,
}

impl Waiting {
    fn done(&self, id: u64) {
        let mut heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        heads.retain(|(i, _)| *i != id);
    }
}

/// Counts a connection open while it lives (an aborted task drops it too).
struct Open(Arc<Waiting>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn accept(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        log::warn!("agent: the listening socket could not be served");
        return;
    };
    let started = Instant::now();
    let waiting = Arc::new(Waiting::default());
    let in_flight = Arc::new(AtomicUsize::new(0));
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, say: a moment for some to close.
                    log::debug!("agent: accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        if waiting.open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            let oldest = waiting
                .heads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            match oldest {
                Some((_, idle)) => idle.abort(),
                None => {
                    waiting.open.fetch_sub(1, Ordering::SeqCst);
                    tokio::spawn(async move {
                        let mut stream = stream;
                        let answer = text(503, "too many connections at once\n");
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            write_answer(&mut stream, &answer, false),
                        )
                        .await;
                    });
                    continue;
                }
            }
        }
        let open = Open(waiting.clone());
        let id = waiting.next.fetch_add(1, Ordering::Relaxed);
        let (shared, in_flight, w) = (shared.clone(), in_flight.clone(), waiting.clone());
        let task = tokio::spawn(async move {
            let _open = open;
            connection(stream, id, &w, shared, in_flight, started).await;
        });
        let mut heads = waiting.heads.lock().unwrap_or_else(|e| e.into_inner());
        if !task.is_finished() {
            heads.push_back((id, task.abort_handle()));
        }
    }
}

/// One connection: its request head read and parsed, answered, closed.
async fn connection(
    mut stream: tokio::net::TcpStream,
    id: u64,
    waiting: &Waiting,
    shared: Arc<Shared>,
    in_flight: Arc<AtomicUsize>,
    started: Instant,
) {
    let head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await;
    waiting.done(id);
    let (method, target) = match head {
        Err(_) => {
            let _ = write_answer(&mut stream, &text(408, "no request in time\n"), false).await;
            return;
        }
        Ok(Err(answer)) => {
            let _ = write_answer(&mut stream, &answer, false).await;
            return;
        }
        Ok(Ok(None)) => return,
        Ok(Ok(Some(request))) => request,
    };
    let head_only = method == "HEAD";
    let answer = if in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
        in_flight.fetch_sub(1, Ordering::SeqCst);
        text(503, "too many requests at once\n")
    } else {
        let answered = tokio::task::spawn_blocking(move || {
            let answer = answer(&method, &target, &shared, started);
            in_flight.fetch_sub(1, Ordering::SeqCst);
            answer
        })
        .await;
        answered.unwrap_or_else(|e| text(500, &format!("{e}\n")))
    };
    let written =
        tokio::time::timeout(WRITE_TIMEOUT, write_answer(&mut stream, &answer, head_only)).await;
    if let Ok(Err(e)) = written {
        log::debug!("agent: answering a request: {e}");
    }
}

/// The request's method and target, `None` when the client closed
/// without sending one, or the answer to a head that cannot be read.
async fn read_head(
    stream: &mut tokio::net::TcpStream,
) -> std::result::Result<Option<(String, String)>, Answer> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| text(400, &format!("{e}\n")))?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => {
                let method = req.method.unwrap_or_default().to_string();
                let target = req.path.unwrap_or_default().to_string();
                return Ok(Some((method, target)));
            }
            Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => {}
            Ok(httparse::Status::Partial) => {
                return Err(text(431, "request head too large\n"));
            }
            Err(httparse::Error::TooManyHeaders) => {
                return Err(text(431, "too many request headers\n"));
            }
            Err(e) => return Err(text(400, &format!("bad request: {e}\n"))),
        }
    }
}

async fn write_answer(
    stream: &mut tokio::net::TcpStream,
    answer: &Answer,
    head_only: bool,
) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        answer.code,
        reason(answer.code),
        answer.body.len()
    );
    for (name, value) in &answer.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await?;
    if !head_only {
        stream.write_all(&answer.body).await?;
    }
    stream.shutdown().await
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// A response: status, headers beside the length, body.
struct Answer {
    code: u16,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn data(body: Vec<u8>) -> Answer {
        Answer {
            code: 200,
            headers: Vec::new(),
            body,
        }
    }

    fn with_header(mut self, name: &'static str, value: &str) -> Answer {
        self.headers.push((name, value.to_string()));
        self
    }
}

fn text(code: u16, body: &str) -> Answer {
    Answer {
        code,
        headers: Vec::new(),
        body: body.as_bytes().to_vec(),
    }
    .with_header("Content-Type", "text/plain; charset=utf-8")
}

fn answer(method: &str, target: &str, shared: &Shared, started: Instant) -> Answer {
    if !matches!(method, "GET" | "HEAD") {
        return text(
            405,
            "only GET: the agent serves what it counted and changes nothing\n",
        )
        .with_header("Allow", "GET, HEAD");
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match route(path, query, shared, started) {
        Ok(r) => r,
        Err((code, why)) => text(code, &format!("{why}\n")),
    }
}

type Routed = std::result::Result<Answer, (u16, String)>;

const INDEX: &str = "\
mtrace agent
  /debug/pprof/allocs   allocations since the start (Go heap profile); ?seconds=N: during the next N seconds
  /debug/pprof/heap     the same, in-use first (live mode only)
                        ?pid=PID: one process's samples only (every sample has pid and comm labels)
  /metrics              Prometheus text format
  /healthz              200 while tracing
";

fn route(path: &str, query: &str, shared: &Shared, started: Instant) -> Routed {
    let query = Query::parse(query)?;
    match path {
        "/" => Ok(text(200, INDEX)),
        "/healthz" => healthz(shared, started),
        "/metrics" => {
            let reading = shared.fresh().map_err(|e| (503, e))?;
            Ok(Answer::data(metrics::render(&reading))
                .with_header("Content-Type", metrics::CONTENT_TYPE))
        }
        "/debug/pprof/allocs" => profile(shared, &query, "alloc_space"),
        "/debug/pprof/heap" => profile(shared, &query, "inuse_space"),
        _ => Err((404, format!("no such page: {path} (see /)"))),
    }
}

fn healthz(shared: &Shared, started: Instant) -> Routed {
    let st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
    match &st.gone {
        Some(why) => Err((503, why.clone())),
        None => Ok(text(
            200,
            &format!("ok: tracing for {:.0} s\n", started.elapsed().as_secs_f64()),
        )),
    }
}

/// What a profile's query asks for.
#[derive(Default)]
struct Query {
    seconds: Option<u64>,
    pid: Option<u32>,
}

impl Query {
    /// Go's parameters that do not apply here (`gc`, `debug`) are let be.
    fn parse(query: &str) -> std::result::Result<Query, (u16, String)> {
        let mut q = Query::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let bad = || (400, format!("bad {k}={v}"));
            match k {
                "seconds" => {
                    let n: u64 = v.parse().map_err(|_| bad())?;
                    if n == 0 || n > MAX_SECONDS {
                        return Err((400, format!("seconds={v}: from 1 to {MAX_SECONDS}")));
                    }
                    q.seconds = Some(n);
                }
                "pid" => q.pid = Some(v.parse().map_err(|_| bad())?),
                _ => {}
            }
        }
        Ok(q)
    }
}

fn profile(shared: &Shared, q: &Query, default_type: &str) -> Routed {
    let first = shared.fresh().map_err(|e| (503, e))?;
    let live = first.profile.live.is_some();
    // In count mode only a Go program's own heap has in-use figures.
    if default_type == "inuse_space" && !live && first.profile.go_heaps.is_empty() {
        return Err((
            501,
            "in-use memory is not tracked: the agent runs in count mode (start it with --live); /debug/pprof/allocs has the allocations".into(),
        ));
    }
    let profile = match q.seconds {
        None => first.profile.clone(),
        Some(n) => {
            let due = first.at + Duration::from_secs(n);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let second: Arc<Reading> = shared.fresh().map_err(|e| (503, e))?;
            let mut window = crate::profile::window::between(&first.profile, &second.profile);
            // The window's own start (pprof's time_nanos).
            window.meta.start_time = humantime::format_rfc3339_seconds(first.wall).to_string();
            window
        }
    };
    let mut profile = match q.pid {
        None => profile,
        Some(pid) => only_process(profile, pid)?,
    };
    crate::profile::window::scale_windows(&mut profile);
    let bytes =
        pprof::render_go_heap(&profile, default_type).map_err(|e| (500, format!("{e:#}")))?;
    Ok(Answer::data(bytes)
        .with_header("Content-Type", "application/octet-stream")
        .with_header(
            "Content-Disposition",
            "attachment; filename=\"profile.pb.gz\"",
        ))
}

/// `?pid=`: the stacks of one process of the scope.
fn only_process(mut profile: Profile, pid: u32) -> std::result::Result<Profile, (u16, String)> {
    let known = profile.meta.pid == pid || profile.meta.processes.iter().any(|p| p.pid == pid);
    if !known {
        return Err((404, format!("pid {pid} is not among the processes traced")));
    }
    profile
        .stacks
        .retain(|e| e.process.as_ref().is_some_and(|p| p.pid == pid));
    Ok(profile)
}
