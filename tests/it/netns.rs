//! Hosts made of Linux network namespaces, for multi-host tests without a
//! cluster (`../shared/notes/multihost.md`): each host is a namespace with
//! its own `eth0`, address and hostname, wired to the others through a
//! bridge in a namespace of its own (the root namespace gets no interface),
//! and each command there runs in a fresh mount namespace with a private
//! temporary folder (a tmpfs as its `TMPDIR`), so anything that assumes a
//! shared temporary folder fails.
//! Open MPI reaches the hosts through its rsh launcher with an agent script
//! (`ip netns exec`), no ssh. Everything is torn down when [`Hosts`] drops,
//! a failing test included: every process in the namespaces is killed,
//! then the namespaces go.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// N hosts on one private /24.
pub struct Hosts {
    prefix: String,
    subnet: u8,
    n: usize,
    dir: tempfile::TempDir,
}

/// Runs `ip ARGS`, panicking with its message when it fails.
fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("ip");
    assert!(o.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

impl Hosts {
    /// `n` hosts, or `None` (with the reason on stderr: the test then
    /// checks nothing) where this machine cannot make them: namespaces
    /// need root and iproute2.
    pub fn new(n: usize) -> Option<Hosts> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: multi-host tests need root (network namespaces); CI runs as root");
            return None;
        }
        if Command::new("ip").arg("-V").output().map(|o| !o.status.success()).unwrap_or(true) {
            eprintln!("SKIPPED: multi-host tests need `ip` (iproute2)");
            return None;
        }
        // Unique per test process and per set, so tests run side by side.
        static SETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let (pid, set) = (std::process::id(), SETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let h = Hosts {
            prefix: format!("m3c{pid}s{set}"),
            subnet: ((pid + set * 37) % 200) as u8 + 20,
            n,
            dir: tempfile::Builder::new().prefix("m3c-hosts-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap(),
        };
        let br = h.bridge();
        ip(&["netns", "add", &br]);
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &br, "link", "set", "br0", "up"]);
        for i in 0..n {
            let ns = h.ns(i);
            ip(&["netns", "add", &ns]);
            let port = format!("v{i}");
            ip(&["link", "add", &port, "netns", &br, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
            ip(&["-n", &br, "link", "set", &port, "master", "br0", "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", h.addr(i)), "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        h.write_agent();
        Some(h)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.prefix)
    }

    /// Host `i`'s namespace, which is also its hostname.
    pub fn ns(&self, i: usize) -> String {
        format!("{}h{i}", self.prefix)
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.{}.{}", self.subnet, i + 1)
    }

    fn script(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `enter NS COMMAND...` runs COMMAND in namespace NS as its own host
    /// (its hostname, a private TMPDIR); the rsh agent, `agent [OPTIONS]
    /// HOST COMMAND...`, runs COMMAND (a shell line, as ssh would) on the
    /// namespace whose address is HOST.
    fn write_agent(&self) {
        // A private tmpfs as TMPDIR rather than over /tmp itself: the
        // checkout (and so the binaries) may live under /tmp. A fresh one
        // over the folder that holds every host's TMPDIR, since the agent
        // enters a host from the launching host's mount namespace, whose
        // private files it must not see.
        let enter = format!(
            "#!/bin/sh\nns=$1; shift\np={}/private\nmkdir -p \"$p\"\n\
             exec ip netns exec \"$ns\" unshare --uts --mount sh -c \
             'hostname \"$0\"; mount -t tmpfs tmpfs \"$1\"; mkdir \"$1/tmp-$0\"; export TMPDIR=\"$1/tmp-$0\"; shift; exec \"$@\"' \"$ns\" \"$p\" \"$@\"\n",
            self.dir.path().display()
        );
        let cases: String = (0..self.n).map(|i| format!("  {}) ns={} ;;\n", self.addr(i), self.ns(i))).collect();
        let agent = format!(
            "#!/bin/sh\n\
             while [ $# -gt 0 ]; do case \"$1\" in -*) shift ;; *) break ;; esac; done\n\
             host=$1; shift\n\
             case \"$host\" in\n{cases}  *) echo \"agent: unknown host $host\" >&2; exit 255 ;;\nesac\n\
             exec {} \"$ns\" sh -c \"$*\"\n",
            self.script("enter").display()
        );
        use std::os::unix::fs::PermissionsExt;
        for (name, text) in [("enter", enter), ("agent", agent)] {
            std::fs::write(self.script(name), text).unwrap();
            std::fs::set_permissions(self.script(name), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }

    /// Runs `args` on host `i` (mpirun there reaches the others through the
    /// agent), killed after `timeout`.
    pub fn run(&self, i: usize, args: &[&str], timeout: Duration) -> Output {
        self.run_env(i, args, &[], timeout)
    }

    /// [`Hosts::run`] with more environment variables.
    pub fn run_env(&self, i: usize, args: &[&str], env: &[(&str, &str)], timeout: Duration) -> Output {
        self.command(i, args, timeout).envs(env.iter().copied()).stdin(Stdio::null()).output().expect("timeout")
    }

    /// `args` on host `i` under `timeout`, with Open MPI's launcher pointed
    /// at the agent and its TCP traffic kept on the hosts' network.
    fn command(&self, i: usize, args: &[&str], timeout: Duration) -> Command {
        let net = format!("10.77.{}.0/24", self.subnet);
        let mut c = Command::new("timeout");
        c.args(["-k", "5", &timeout.as_secs().to_string()])
            .arg(self.script("enter"))
            .arg(self.ns(i))
            .args(args)
            .env("OMPI_MCA_plm_rsh_agent", self.script("agent"))
            .env("OMPI_MCA_plm_rsh_no_tree_spawn", "1")
            .env("OMPI_MCA_btl_tcp_if_include", &net)
            .env("OMPI_MCA_oob_tcp_if_include", &net);
        c
    }

    /// The folder the test may share between hosts (the repo's disk, as a
    /// cluster's home folders are).
    pub fn shared(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in (0..self.n).map(|i| self.ns(i)).chain([self.bridge()]) {
            if let Ok(o) = Command::new("ip").args(["netns", "pids", &ns]).output() {
                for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

impl Hosts {
    /// Takes host `i`'s link to the others down (its bridge port).
    pub fn cut(&self, i: usize) {
        ip(&["-n", &self.bridge(), "link", "set", &format!("v{i}"), "down"]);
    }

    /// Brings host `i`'s link back up (after [`Hosts::cut`]).
    pub fn mend(&self, i: usize) {
        ip(&["-n", &self.bridge(), "link", "set", &format!("v{i}"), "up"]);
    }

    /// Whether every host's namespace is empty of processes within `limit`
    /// (a cut-off host's stage ends itself after the timeout, its Open MPI
    /// daemon a few seconds later; a loaded machine takes longer).
    pub fn quiet(&self, limit: Duration) -> bool {
        let t0 = std::time::Instant::now();
        loop {
            if (0..self.n).all(|i| self.pids(i).is_empty()) {
                return true;
            }
            if t0.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Asserts that every host is empty of processes within `limit` (see
    /// [`Hosts::quiet`]), naming `what` ran and what is left if not; how
    /// long they took.
    pub fn assert_quiet(&self, what: &str, limit: Duration) -> Duration {
        let t0 = std::time::Instant::now();
        assert!(self.quiet(limit), "{what}: processes left: {}", self.left());
        t0.elapsed()
    }

    /// The processes left in host `i`'s namespace.
    pub fn pids(&self, i: usize) -> Vec<String> {
        let o = Command::new("ip").args(["netns", "pids", &self.ns(i)]).output().expect("ip");
        String::from_utf8_lossy(&o.stdout).split_whitespace().map(str::to_string).collect()
    }

    /// The processes left on every host, each with its command line and
    /// where each of its threads waits (state and kernel wait channel), for
    /// a failure message.
    pub fn left(&self) -> String {
        let cmdline = |p: &str| std::fs::read(format!("/proc/{p}/cmdline")).map(|c| String::from_utf8_lossy(&c).replace('\0', " "));
        let threads = |p: &str| -> String {
            let Ok(dir) = std::fs::read_dir(format!("/proc/{p}/task")) else { return String::new() };
            dir.flatten()
                .map(|t| {
                    let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                    let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("?").to_string();
                    let wchan = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
                    format!("{}:{state}:{wchan}", t.file_name().to_string_lossy())
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        (0..self.n)
            .flat_map(|i| self.pids(i).into_iter().map(move |p| (i, p)))
            .map(|(i, p)| format!("\n  host {i}, pid {p}: {}\n    threads: {}", cmdline(&p).unwrap_or_default(), threads(&p)))
            .collect()
    }

    /// Starts `args` on host `i` without waiting (see [`Hosts::run`]).
    pub fn spawn(&self, i: usize, args: &[&str], timeout: Duration) -> std::process::Child {
        self.command(i, args, timeout).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("timeout")
    }
}
