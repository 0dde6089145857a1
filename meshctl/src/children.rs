//! Child processes that `meshctl up` and `meshctl bench sweep` start: spawned
//! with their output in a log file, stopped with SIGTERM (then killed after a
//! grace period), and killed if meshctl itself goes away.
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// The binaries are installed side by side; find a sibling of this executable.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("locating meshctl")?;
    let path = me.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{name} not found next to meshctl at {}; build the workspace (cargo build --release)",
            path.display()
        );
    }
    Ok(path)
}

/// A group of named child processes.
#[derive(Default)]
pub struct Children(Vec<(String, Child)>);

impl Children {
    /// Starts `bin args` as `name`, with stdout and stderr in `log`.
    pub fn spawn(
        &mut self,
        name: &str,
        bin: &Path,
        args: &[String],
        log: &Path,
    ) -> anyhow::Result<()> {
        let file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(bin)
            .args(args)
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        self.0.push((name.to_string(), child));
        Ok(())
    }

    /// SIGTERM to all (workers drain), then a kill for any still running after `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        for (_, child) in &self.0 {
            if let Some(pid) = child.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
        for (name, child) in &mut self.0 {
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                eprintln!("{name} did not stop in {} s; killing it", grace.as_secs());
                let _ = child.kill().await;
            }
        }
        self.0.clear();
    }

    /// The first child that exited, if any.
    pub fn exited(&mut self) -> Option<String> {
        self.0.iter_mut().find_map(|(name, c)| match c.try_wait() {
            Ok(Some(status)) => Some(format!("{name} exited ({status})")),
            _ => None,
        })
    }
}
