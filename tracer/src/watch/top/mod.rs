//! `mtrace top`: a full-screen live view of a trace under way (ratatui).
//!
//! Every second the session hands it the profile so far; it shows the top
//! stacks by their rate over the last second or by their totals, sorted by
//! calls, bytes or (live mode) live bytes, with the selected stack expanded,
//! the totals, the losses and a sparkline of the allocation rate. `q` (or
//! Ctrl-C) ends the trace, and the usual report follows: nothing is lost by
//! watching.
//!
//! The view is drawn on standard error (which must be a terminal) in the
//! alternate screen; keys are read by a thread of their own, which redraws
//! at once on a key and tells the session when to stop.

mod draw;
mod model;
#[cfg(test)]
mod tests;

use std::{
    io::{IsTerminal, Stderr},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Result;
use ratatui::{
    backend::CrosstermBackend,
    crossterm::{
        event::{self, Event, KeyCode, KeyEventKind, KeyModifiers},
        execute,
        terminal::{self, EnterAlternateScreen, LeaveAlternateScreen},
    },
    Terminal,
};
use tokio::sync::oneshot;

use crate::{
    error::{UserError, EXIT_USAGE},
    profile::Profile,
    render::{text::shown_profile, SortKey},
    watch::{Tick, Watcher},
};

use draw::draw;
use model::{Model, UiState};

struct Screen {
    terminal: Terminal<CrosstermBackend<Stderr>>,
    model: Model,
    state: UiState,
}

impl Screen {
    fn redraw(&mut self) {
        let Screen {
            terminal,
            model,
            state,
        } = self;
        if let Err(e) = terminal.draw(|f| draw(f, model, state)) {
            log::debug!("drawing the live view: {e}");
        }
    }
}

/// The live view while it runs: the screen, and the thread reading keys.
pub struct TopView {
    screen: Arc<Mutex<Screen>>,
    done: Arc<AtomicBool>,
    /// The reader pressed q, Esc or Ctrl-C.
    quit: Arc<AtomicBool>,
    keys: Option<JoinHandle<()>>,
}

impl TopView {
    /// Takes over the terminal (standard error); returns the view and what
    /// tells the session to stop (`q`). Rows are per process from the
    /// start when `by_process` (the host scope's "who allocates").
    pub fn start(
        title: String,
        live: bool,
        by_process: bool,
    ) -> Result<(TopView, oneshot::Receiver<()>)> {
        check_terminal()?;
        terminal::enable_raw_mode()?;
        let mut err = std::io::stderr();
        if let Err(e) = execute!(err, EnterAlternateScreen) {
            let _ = terminal::disable_raw_mode();
            return Err(e.into());
        }
        // (Not `Terminal::clear`: it asks the terminal for the cursor's
        // position on standard output, which may be a file. The alternate
        // screen starts blank.)
        let terminal = Terminal::new(CrosstermBackend::new(std::io::stderr()))?;
        let screen = Arc::new(Mutex::new(Screen {
            terminal,
            model: Model::new(title, live),
            state: UiState {
                by_process,
                ..UiState::default()
            },
        }));
        screen.lock().unwrap().redraw();
        let done = Arc::new(AtomicBool::new(false));
        let quit = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop_rx) = oneshot::channel();
        let keys = {
            let (screen, done, quit) = (screen.clone(), done.clone(), quit.clone());
            std::thread::Builder::new()
                .name("mtrace-top-keys".into())
                .spawn(move || read_keys(screen, done, quit, stop_tx))?
        };
        Ok((
            TopView {
                screen,
                done,
                quit,
                keys: Some(keys),
            },
            stop_rx,
        ))
    }
}

/// The view needs a terminal: said before anything is attached.
pub fn check_terminal() -> Result<()> {
    if std::io::stderr().is_terminal() {
        Ok(())
    } else {
        Err(anyhow::Error::new(UserError::with_code(
            "mtrace top needs a terminal on standard error",
            EXIT_USAGE,
        )))
    }
}

fn read_keys(
    screen: Arc<Mutex<Screen>>,
    done: Arc<AtomicBool>,
    quit: Arc<AtomicBool>,
    stop: oneshot::Sender<()>,
) {
    let mut stop = Some(stop);
    while !done.load(Ordering::Relaxed) {
        match event::poll(Duration::from_millis(100)) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) => break,
        }
        let Ok(ev) = event::read() else { break };
        let mut s = screen.lock().unwrap();
        match ev {
            Event::Key(k) if k.kind != KeyEventKind::Release => {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                let live = s.model.live;
                let st = &mut s.state;
                match k.code {
                    _ if ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) => {
                        quit.store(true, Ordering::Relaxed);
                        if let Some(tx) = stop.take() {
                            let _ = tx.send(());
                        }
                    }
                    KeyCode::Down | KeyCode::Char('j') => st.table.select_next(),
                    KeyCode::Up | KeyCode::Char('k') => st.table.select_previous(),
                    KeyCode::PageDown => st.table.scroll_down_by(10),
                    KeyCode::PageUp => st.table.scroll_up_by(10),
                    KeyCode::Home => st.table.select_first(),
                    KeyCode::Enter | KeyCode::Char(' ') => st.expanded = !st.expanded,
                    KeyCode::Char('c') => st.sort = SortKey::Calls,
                    KeyCode::Char('b') => st.sort = SortKey::Bytes,
                    KeyCode::Char('l') if live => st.sort = SortKey::Live,
                    KeyCode::Char('t') | KeyCode::Char('r') => st.by_rate = !st.by_rate,
                    KeyCode::Char('p') => st.by_process = !st.by_process,
                    _ => {}
                }
                s.redraw();
            }
            Event::Resize(..) => s.redraw(),
            _ => {}
        }
    }
}

impl Watcher for TopView {
    fn tick(&mut self, tick: &Tick, profile: &dyn Fn() -> Result<Profile>) -> Result<()> {
        let profile = profile()?;
        let profile = shown_profile(&profile);
        let mut s = self.screen.lock().unwrap();
        s.model.update(&profile, tick);
        s.redraw();
        Ok(())
    }

    /// The last state stays on the screen until q: the target's exit
    /// must not take it away before it has been read.
    fn ended(&mut self, why: &str, tick: &Tick, profile: &dyn Fn() -> Result<Profile>) {
        self.ended_view(why, tick, profile);
    }
}

impl TopView {
    fn ended_view(&mut self, why: &str, tick: &Tick, profile: &dyn Fn() -> Result<Profile>) {
        if self.quit.load(Ordering::Relaxed) {
            return;
        }
        {
            let mut s = self.screen.lock().unwrap();
            // The final counts; where they cannot be read, the last shown
            // stay, and the title says so.
            let unread = match profile() {
                Ok(p) => {
                    s.model.update(&shown_profile(&p), tick);
                    String::new()
                }
                Err(e) => format!(" (the last counts shown: the final ones are unreadable: {e})"),
            };
            s.model.title = format!(
                "tracing ended ({why}){unread}, q for the report; {}",
                s.model.title
            );
            s.redraw();
        }
        while !self.quit.load(Ordering::Relaxed) && !self.done.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for TopView {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(keys) = self.keys.take() {
            let _ = keys.join();
        }
        let mut s = self.screen.lock().unwrap();
        let _ = s.terminal.show_cursor();
        let _ = execute!(std::io::stderr(), LeaveAlternateScreen);
        let _ = terminal::disable_raw_mode();
    }
}

/// Launch mode: the command's standard input, output and error while the
/// view has the terminal (input from /dev/null, output and error to a log
/// file), set on mtrace's own descriptors for the command to inherit, and
/// mtrace's put back once it is started.
pub struct Redirect {
    saved: Vec<(i32, std::os::fd::OwnedFd)>,
    pub log: std::path::PathBuf,
}

impl Redirect {
    pub fn start() -> Result<Redirect> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let (file, log) = tempfile::Builder::new()
            .prefix("mtrace-top-")
            .suffix(".log")
            .tempfile()?
            .keep()?;
        let null = std::fs::File::open("/dev/null")?;
        let mut saved = Vec::new();
        for (fd, to) in [
            (0, null.as_raw_fd()),
            (1, file.as_raw_fd()),
            (2, file.as_raw_fd()),
        ] {
            // SAFETY: plain descriptor calls; the duplicate is owned here.
            let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
            if copy < 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            saved.push((fd, unsafe { OwnedFd::from_raw_fd(copy) }));
            if unsafe { libc::dup2(to, fd) } < 0 {
                return Err(std::io::Error::last_os_error().into());
            }
        }
        Ok(Redirect { saved, log })
    }
}

impl Drop for Redirect {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        for (fd, copy) in &self.saved {
            // SAFETY: puts back a descriptor we duplicated.
            unsafe { libc::dup2(copy.as_raw_fd(), *fd) };
        }
    }
}
