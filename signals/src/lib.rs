//! What m3c undoes when it is interrupted (SIGINT, SIGTERM, SIGHUP) or when
//! LLVM aborts (the compiler's fatal-error handler calls [`remove_temps`]):
//! temporary output folders are removed, and a running `mpirun` gets the
//! signal too, so no stage is left computing.
//!
//! The compiler (atomic output folders), the front (`m3c run`'s mpirun) and
//! the server (graceful shutdown) share this one signal thread, so it is a
//! crate of its own below all three.
//!
//! A dedicated thread receives the signals (signal-hook), so the cleanup
//! runs as ordinary code, not inside a signal handler.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

static TEMPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// The pid of the `mpirun` that `m3c run` waits for, or 0.
static CHILD: AtomicI32 = AtomicI32::new(0);
/// The last signal received while a child ran, or 0.
static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// A program that handles the signals itself (`m3c serve`'s graceful
/// shutdown): the signal thread hands them over instead of acting.
type Handler = Box<dyn Fn(i32) + Send>;
static HANDLER: Mutex<Option<Handler>> = Mutex::new(None);

/// From now on SIGINT, SIGTERM and SIGHUP go to `f` (on the signal thread).
pub fn handle_with(f: impl Fn(i32) + Send + 'static) {
    if let Ok(mut h) = HANDLER.lock() {
        *h = Some(Box::new(f));
    }
}

/// Starts the signal thread (once, from `cli::main`).
pub fn install() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
        return; // no handler: the default action still ends the process
    };
    std::thread::spawn(move || {
        for sig in signals.forever() {
            if let Ok(h) = HANDLER.lock() {
                if let Some(f) = h.as_ref() {
                    f(sig);
                    continue;
                }
            }
            let child = CHILD.load(Ordering::SeqCst);
            if child > 0 {
                // mpirun ends the job on SIGINT/SIGTERM; a second signal
                // means "now": kill it outright.
                let again = RECEIVED.swap(sig, Ordering::SeqCst) != 0;
                // SAFETY: kill(2) on the pid of our own child, which we have not reaped yet.
                unsafe { libc::kill(child, if again { libc::SIGKILL } else { sig }) };
                continue;
            }
            remove_temps();
            eprintln!("m3c: interrupted (signal {sig}); nothing was left half written");
            // SAFETY: _exit ends the process without running destructors or
            // atexit handlers, which could race with the threads still
            // compiling (LLVM's statics).
            unsafe { libc::_exit(128 + sig) };
        }
    });
}

/// Removes every registered temporary folder (best effort).
pub fn remove_temps() {
    let temps = match TEMPS.lock() {
        Ok(t) => t.clone(),
        Err(p) => p.into_inner().clone(),
    };
    for t in temps {
        std::fs::remove_dir_all(&t).ok();
    }
}

/// A temporary folder that an interruption must remove; unregistered on drop.
pub struct TempRegistration(PathBuf);

impl TempRegistration {
    pub fn new(path: &Path) -> TempRegistration {
        if let Ok(mut t) = TEMPS.lock() {
            t.push(path.to_path_buf());
        }
        TempRegistration(path.to_path_buf())
    }
}

impl Drop for TempRegistration {
    fn drop(&mut self) {
        if let Ok(mut t) = TEMPS.lock() {
            t.retain(|p| p != &self.0);
        }
    }
}

/// The child `m3c run` waits for: signals are forwarded to it while this lives.
pub struct ChildRegistration;

impl ChildRegistration {
    pub fn new(pid: u32) -> ChildRegistration {
        RECEIVED.store(0, Ordering::SeqCst);
        CHILD.store(pid as i32, Ordering::SeqCst);
        ChildRegistration
    }

    /// The signal forwarded to the child, if any.
    pub fn received(&self) -> Option<i32> {
        Some(RECEIVED.load(Ordering::SeqCst)).filter(|&s| s != 0)
    }
}

impl Drop for ChildRegistration {
    fn drop(&mut self) {
        CHILD.store(0, Ordering::SeqCst);
    }
}
