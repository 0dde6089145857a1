//! Child processes of the suites: where the workspace's binaries are, free
//! loopback ports, a supervisor that kills its process when dropped, and a
//! poll helper so that tests wait on conditions, never on fixed sleeps.
use crate::pki::{channel, Creds};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Where the release binaries are: `TOKENMESH_BIN_DIR`, else the profile
/// directory this test binary was built into (target/<profile>/deps/..).
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TOKENMESH_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// A binary of the workspace; it must have been built (`cargo build --release`).
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: build the workspace first (cargo build --release --workspace)",
        p.display()
    );
    p
}

/// A loopback port that is free now and that no earlier call in this
/// process returned.
///
/// Drawn from below the kernel's ephemeral range: a port from `bind(0)`
/// goes back into that range when probed, and the client sockets of the
/// tests running beside this one could take it before the child binds it
/// (CI saw a router refuse its `--http-listen` port that way). Ports below
/// the range are never handed to clients; a per-process counter keeps two
/// calls apart, and a start drawn from the process id keeps two test
/// binaries apart.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let high = ephemeral_low();
    if high < LOW + 1_000 {
        // No room below the range on this host: fall back to the kernel's pick.
        return std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("binding an ephemeral port");
    }
    let span = high - LOW;
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (start + n) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {LOW} and {high}")
}

/// The first port of the kernel's ephemeral range (Linux's default if it
/// cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A child process killed (SIGKILL) when dropped, with its output in a log file.
pub struct Proc {
    /// Names its log file and failure messages.
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `program args`, logging to `dir/name.log`.
    pub fn spawn(name: &str, program: &Path, args: &[String], dir: &Path) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Self {
            name: name.into(),
            child,
            log,
        })
    }

    /// The process id.
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }

    /// Sends a signal.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(self.pid(), sig);
    }

    /// Waits up to `timeout` for the process to exit; its exit code if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sends SIGTERM and waits up to `timeout` for the process to exit; its
    /// exit status (the test fails if it keeps running).
    pub fn terminate(&mut self, timeout: Duration) -> std::process::ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        self.wait_exit(timeout).unwrap_or_else(|| {
            panic!(
                "{} still runs {timeout:?} after SIGTERM:\n{}",
                self.name,
                self.log_text()
            )
        })
    }

    /// True while the process runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits up to `timeout` until the log contains `text`.
    pub async fn wait_for_log(&self, text: &str, timeout: Duration) -> bool {
        eventually(timeout, || async { self.log_text().contains(text) }).await
    }

    /// The log so far, for failure messages.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Polls `probe` with a channel to `addr` (mutual TLS with `creds`) every
/// 50 ms until it answers true: a process that was just started serves.
/// Fails with the process's log if it exits or `timeout` passes first.
pub(crate) async fn wait_serving<F, Fut>(
    proc: &mut Proc,
    what: &str,
    timeout: Duration,
    (addr, creds): (&str, Option<&Creds>),
    mut probe: F,
) -> Result<()>
where
    F: FnMut(Channel) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(ch) = channel(addr, creds).await {
            if probe(ch).await {
                return Ok(());
            }
        }
        anyhow::ensure!(
            proc.running() && Instant::now() <= deadline,
            "{what} did not start:\n{}",
            proc.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `--tls-dir DIR`, or `--insecure` without one.
pub(crate) fn transport_args(tls_dir: Option<&Path>) -> Vec<String> {
    match tls_dir {
        Some(d) => vec!["--tls-dir".into(), d.display().to_string()],
        None => vec!["--insecure".into()],
    }
}

/// `name` on `PATH`, if it is there.
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}
