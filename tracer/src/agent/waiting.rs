//! The server's connections still waiting for their request head, oldest
//! first, and which of them to close when room is needed: by what waits
//! on each one's socket, looked at without reading it (the bounds are
//! [`super::http`]'s).

use std::{
    collections::VecDeque,
    os::fd::RawFd,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

use super::http::{MAX_CONNECTIONS, MIN_IDLE};

/// A connection still waiting for its request head.
pub(super) struct Head {
    pub(super) id: u64,
    /// When it was accepted.
    pub(super) since: std::time::Instant,
    /// Its socket, to see whether bytes wait on it. The entry leaves the
    /// list before the socket is closed, and both happen on the server's
    /// one thread, so the descriptor is this connection's.
    pub(super) fd: RawFd,
    /// It has sent something (its task saw the socket readable).
    pub(super) stirred: Arc<AtomicBool>,
    /// It is counted open (cleared when it is closed for another, which
    /// uncounts it at once).
    pub(super) counted: Arc<AtomicBool>,
    pub(super) task: tokio::task::AbortHandle,
}

/// Connections still waiting for their request head, oldest first.
#[derive(Default)]
pub(super) struct Waiting {
    pub(super) next: AtomicU64,
    pub(super) open: AtomicUsize,
    pub(super) heads: Mutex<VecDeque<Head>>,
}

impl Waiting {
    pub(super) fn done(&self, id: u64) {
        let mut heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        heads.retain(|h| h.id != id);
    }

    /// Closes the oldest connection waiting for its head to make room:
    /// one that has sent nothing, else one whose head has not come whole.
    /// False when every one has a whole head waiting to be read.
    pub(super) fn make_room(&self) -> bool {
        let mut heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        let waiting: Vec<Pending> = heads.iter().map(Head::pending).collect();
        let victim = (waiting.iter().position(|p| *p == Pending::Nothing))
            .or_else(|| waiting.iter().position(|p| *p == Pending::Some));
        match victim.and_then(|i| heads.remove(i)) {
            Some(h) => {
                self.close(&h);
                true
            }
            None => false,
        }
    }

    /// While more than [`MAX_CONNECTIONS`] are open, closes the oldest
    /// that have sent nothing for at least [`MIN_IDLE`].
    pub(super) fn close_idle(&self) {
        let mut excess = self
            .open
            .load(Ordering::SeqCst)
            .saturating_sub(MAX_CONNECTIONS);
        if excess == 0 {
            return;
        }
        let mut heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        heads.retain(|h| {
            let idle = excess > 0
                && now.duration_since(h.since) >= MIN_IDLE
                && h.pending() == Pending::Nothing;
            if idle {
                self.close(h);
                excess -= 1;
            }
            !idle
        });
    }

    /// Closes `h`, taken out of the list, and uncounts it at once.
    fn close(&self, h: &Head) {
        h.task.abort();
        if h.counted.swap(false, Ordering::SeqCst) {
            self.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Head {
    fn pending(&self) -> Pending {
        if self.stirred.load(Ordering::Relaxed) {
            Pending::Some
        } else {
            pending(self.fd)
        }
    }
}

/// What waits on a connection's socket, unread.
#[derive(PartialEq, Eq)]
enum Pending {
    /// Nothing (or the client has closed it).
    Nothing,
    /// Bytes, not a whole request head.
    Some,
    /// A whole request head.
    Head,
}

/// What waits on `fd`, looked at without reading it.
fn pending(fd: RawFd) -> Pending {
    let mut buf = [0u8; 2048];
    // SAFETY: `fd` is an open socket (see `Head::fd`); `buf` is writable
    // for its length.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match usize::try_from(n) {
        Ok(0) | Err(_) => Pending::Nothing,
        Ok(n) => {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            match httparse::Request::new(&mut headers).parse(&buf[..n]) {
                Ok(httparse::Status::Complete(_)) => Pending::Head,
                // A head larger than what was looked at, or TLS: bytes.
                _ => Pending::Some,
            }
        }
    }
}
