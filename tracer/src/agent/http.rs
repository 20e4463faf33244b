//! The agent's HTTP server: GET and HEAD only, nothing that writes.
//!
//! Connections are tokio tasks on a thread of their own (an idle one
//! costs a few KiB, not a thread); with `--web-config` each is a TLS
//! connection (rustls) and its requests need a user's password or a
//! client certificate ([`super::web`]); a request's head is parsed by
//! `httparse`; what is answered, and how much of each kind at once, is
//! [`super::pages`]'. Every answer closes its connection. Written here
//! rather than taken whole from a crate: tiny_http (used before) gives
//! every connection a thread for as long as the client keeps it open and
//! has neither a limit nor a timeout, so a local client that opened
//! connections and sent nothing made the agent's threads grow without
//! bound; hyper would bring a server framework for four GET routes.
//!
//! Bounds: [`MAX_CONNECTIONS`] open; past them, connections that have
//! sent nothing for [`MIN_IDLE`] are closed, the longest waiting first
//! (looked at when one comes and every 100 ms), so idle connections
//! cannot lock a scraper out, and a client that sends its request within
//! [`MIN_IDLE`] of connecting is never closed for another, however fast
//! idle ones reconnect. At [`MAX_OPEN`] a new connection closes the
//! longest idle one whatever its age (then one that has sent bytes, but
//! never one whose request head has come whole). A head (the TLS
//! handshake included) within [`HEAD_TIMEOUT`] and [`MAX_HEAD`] bytes; an
//! answer written within [`WRITE_TIMEOUT`]. The listening socket's
//! backlog holds [`BACKLOG`] connections not yet accepted.

use std::{
    net::{SocketAddr, TcpListener},
    os::fd::AsRawFd,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{
    pages::{text, Answer, Pages},
    waiting::{Head, Waiting},
    web::WebConfig,
    Shared,
};
use crate::error::{UserError, EXIT_USAGE};

/// Connections open at once past which idle ones are closed.
pub(super) const MAX_CONNECTIONS: usize = 64;

/// How long a connection may send nothing before it may be closed for
/// another.
pub(super) const MIN_IDLE: Duration = Duration::from_secs(1);

/// Connections open at once at most (a few KiB each; the agent raises its
/// descriptor limit).
const MAX_OPEN: usize = 512;

/// How long a connection may take to send its request head (after its
/// TLS handshake, which counts too).
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest request head read (431 beyond).
const MAX_HEAD: usize = 16 * 1024;

/// How long an answer may take to be written (a client that reads
/// nothing is dropped).
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections the kernel holds for the agent before it accepts them: a
/// reconnect storm of hundreds at once finds room (the kernel bounds it
/// by `net.core.somaxconn`, 4096 by default).
const BACKLOG: i32 = 1024;

/// Password checks (bcrypt, tens of milliseconds of CPU each) at once at
/// most; a password checked before is remembered and costs nothing.
const MAX_PASSWORD_CHECKS: usize = 2;

/// A connection, plain or TLS.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// `--listen` and what goes with it.
pub struct Listen {
    pub addr: SocketAddr,
    /// `--web-config`: TLS and basic auth.
    pub web_config: Option<PathBuf>,
    /// `--insecure-listen`: an address that is not loopback may be served
    /// without TLS and authentication.
    pub insecure: bool,
}

/// The listening socket, bound before anything is attached (a port in
/// use is a usage error, not a trace lost), then served.
pub struct Server {
    listener: Option<TcpListener>,
    pub addr: SocketAddr,
    web: Option<Arc<WebConfig>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Reads `--web-config` and binds `--listen`; an address that is not
    /// loopback is refused without TLS and authentication unless
    /// `--insecure-listen` says so.
    pub fn bind(listen: &Listen) -> Result<Server> {
        let addr = listen.addr;
        let loopback = addr.ip().is_loopback();
        if !loopback && listen.web_config.is_none() && !listen.insecure {
            return Err(anyhow::Error::new(UserError::with_code(
                format!("--listen {addr} is not loopback: give --web-config FILE (TLS and basic auth, as Prometheus exporters take it), or --insecure-listen to let any host that reaches it read the profiles"),
                EXIT_USAGE,
            )));
        }
        let web = listen
            .web_config
            .as_deref()
            .map(|p| WebConfig::load(p, !loopback && !listen.insecure))
            .transpose()?
            .map(Arc::new);
        let listener =
            listen_on(addr).map_err(|e| crate::user_error!("cannot listen on {addr}: {e}"))?;
        let addr = listener.local_addr()?;
        Ok(Server {
            listener: Some(listener),
            addr,
            web,
            stop: None,
            thread: None,
        })
    }

    /// Where it serves and what that lets in, said once at the start.
    pub fn describe(&self) -> String {
        let loaded = self.web.as_ref().and_then(|w| w.current().ok());
        let scheme = match loaded.as_ref().and_then(|l| l.tls.as_ref()) {
            Some(_) => "https",
            None => "http",
        };
        let addr = self.addr;
        let access = loaded.as_ref().map(|l| l.describe());
        match (addr.ip().is_loopback(), access) {
            (true, None) => format!("serving on {scheme}://{addr}/ (loopback only)"),
            (true, Some(access)) => {
                format!("serving on {scheme}://{addr}/ (loopback only; {access})")
            }
            (false, Some(access)) if loaded.as_ref().is_some_and(|l| l.secured()) => {
                format!("serving on {scheme}://{addr}/ (NOT loopback; {access})")
            }
            (false, access) => format!(
                "serving on {scheme}://{addr}/: NOT loopback, {}: any host that reaches this address can read the profiles",
                access.unwrap_or_else(|| "neither TLS nor authentication".into())
            ),
        }
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
        let ctx = Arc::new(Ctx {
            pages: Pages::new(shared),
            web: self.web.clone(),
            waiting: Waiting::default(),
            password_checks: tokio::sync::Semaphore::new(MAX_PASSWORD_CHECKS),
        });
        let thread = std::thread::Builder::new()
            .name("mtrace-agent-http".into())
            .spawn(move || {
                runtime.block_on(accept(listener, ctx, stopped));
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

/// A listening socket on `addr` with [`BACKLOG`] (std's is 128).
fn listen_on(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// What every connection's task shares.
struct Ctx {
    pages: Pages,
    web: Option<Arc<WebConfig>>,
    waiting: Waiting,
    password_checks: tokio::sync::Semaphore,
}

/// Counts a connection open while it lives, unless it was uncounted when
/// closed for another (an aborted task drops it too).
struct Open(Arc<Ctx>, Arc<AtomicBool>);

impl Drop for Open {
    fn drop(&mut self) {
        if self.1.swap(false, Ordering::SeqCst) {
            self.0.waiting.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

async fn accept(
    listener: TcpListener,
    ctx: Arc<Ctx>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        log::warn!("agent: the listening socket could not be served");
        return;
    };
    let mut look = tokio::time::interval(Duration::from_millis(100));
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            _ = look.tick() => {
                ctx.waiting.close_idle();
                continue;
            }
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
        let _ = stream.set_nodelay(true);
        if ctx.waiting.open.load(Ordering::SeqCst) >= MAX_OPEN && !ctx.waiting.make_room() {
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
        ctx.waiting.open.fetch_add(1, Ordering::SeqCst);
        let counted = Arc::new(AtomicBool::new(true));
        let open = Open(ctx.clone(), counted.clone());
        let id = ctx.waiting.next.fetch_add(1, Ordering::Relaxed);
        let stirred = Arc::new(AtomicBool::new(false));
        let fd = stream.as_raw_fd();
        let (c, s) = (ctx.clone(), stirred.clone());
        let task = tokio::spawn(async move {
            let _open = open;
            connection(stream, id, &c, &s).await;
        });
        {
            let mut heads = ctx.waiting.heads.lock().unwrap_or_else(|e| e.into_inner());
            if !task.is_finished() {
                heads.push_back(Head {
                    id,
                    since: std::time::Instant::now(),
                    fd,
                    stirred,
                    counted,
                    task: task.abort_handle(),
                });
            }
        }
        ctx.waiting.close_idle();
        // The connections accepted so far read what they have before the
        // next is accepted (and may have to make room).
        tokio::task::yield_now().await;
    }
}

/// One connection: TLS if configured, its request head read, its user
/// checked, answered, closed.
async fn connection(tcp: tokio::net::TcpStream, id: u64, ctx: &Ctx, stirred: &AtomicBool) {
    let deadline = tokio::time::Instant::now() + HEAD_TIMEOUT;
    // Until the client sends something (or closes): a peek, since tokio
    // takes a new socket as readable before anything came.
    let _ = tokio::time::timeout_at(deadline, tcp.peek(&mut [0u8; 1])).await;
    stirred.store(true, Ordering::Relaxed);
    let loaded = match ctx.web.as_ref().map(|w| w.current()).transpose() {
        Ok(l) => l,
        Err(_) => return,
    };
    let mut io: Box<dyn Io> = match loaded.as_ref().and_then(|l| l.tls.clone()) {
        None => Box::new(tcp),
        Some(acceptor) => match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => Box::new(tls),
            Ok(Err(e)) => {
                log::debug!("agent: TLS handshake: {e}");
                return;
            }
            Err(_) => return,
        },
    };
    let head = tokio::time::timeout_at(deadline, read_head(&mut io)).await;
    ctx.waiting.done(id);
    let request = match head {
        Err(_) => {
            let _ = write_answer(&mut io, &text(408, "no request in time\n"), false).await;
            return;
        }
        Ok(Err(answer)) => {
            let _ = write_answer(&mut io, &answer, false).await;
            return;
        }
        Ok(Ok(None)) => return,
        Ok(Ok(Some(request))) => request,
    };
    let head_only = request.method == "HEAD";
    let answer = match (&ctx.web, &loaded) {
        (Some(web), Some(l)) if l.needs_password() => {
            authorized(ctx, web, l, request.authorization.as_deref()).await
        }
        _ => None,
    };
    let answer = match answer {
        Some(refused) => refused,
        None => match ctx
            .pages
            .answer(&request.method, &request.target, io.as_mut())
            .await
        {
            Some(a) => a,
            // The client has gone: nothing to answer.
            None => return,
        },
    };
    let written =
        tokio::time::timeout(WRITE_TIMEOUT, write_answer(&mut io, &answer, head_only)).await;
    if let Ok(Err(e)) = written {
        log::debug!("agent: answering a request: {e}");
    }
}

/// None when `authorization` names a user with its password, else the
/// answer that refuses the request.
async fn authorized(
    ctx: &Ctx,
    web: &Arc<WebConfig>,
    loaded: &Arc<super::web::Loaded>,
    authorization: Option<&str>,
) -> Option<Answer> {
    let ok = match web.remembered(loaded, authorization) {
        Some(ok) => ok,
        None => {
            let Ok(_turn) = tokio::time::timeout(HEAD_TIMEOUT, ctx.password_checks.acquire()).await
            else {
                return Some(text(503, "too many password checks at once\n"));
            };
            let (web, loaded) = (web.clone(), loaded.clone());
            let authorization = authorization.map(str::to_string);
            tokio::task::spawn_blocking(move || web.check(&loaded, authorization.as_deref()))
                .await
                .unwrap_or(false)
        }
    };
    (!ok).then(|| {
        text(401, "a user and its password are needed (basic auth)\n")
            .with_header("WWW-Authenticate", "Basic realm=\"mtrace agent\"")
    })
}

/// Resolves once the client has closed the connection (or it failed):
/// a request whose client has gone is not waited for. Whatever the
/// client sends meanwhile is read and dropped. A client that closes only
/// its sending side is taken as gone too, as Go's HTTP server takes it.
pub async fn gone(io: &mut dyn Io) {
    let mut buf = [0u8; 512];
    loop {
        match io.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// A request's method, target and `Authorization` header.
struct Request {
    method: String,
    target: String,
    authorization: Option<String>,
}

/// The request, `None` when the client closed without sending one, or
/// the answer to a head that cannot be read.
async fn read_head(io: &mut Box<dyn Io>) -> std::result::Result<Option<Request>, Answer> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = io
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
                let authorization = req
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("authorization"))
                    .map(|h| String::from_utf8_lossy(h.value).into_owned());
                return Ok(Some(Request {
                    method: req.method.unwrap_or_default().to_string(),
                    target: req.path.unwrap_or_default().to_string(),
                    authorization,
                }));
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

async fn write_answer<W: AsyncWrite + Unpin + ?Sized>(
    io: &mut W,
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
    io.write_all(head.as_bytes()).await?;
    if !head_only {
        io.write_all(&answer.body).await?;
    }
    io.shutdown().await
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
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
