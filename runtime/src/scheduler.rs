//! The async runtime a server runs on (`--runtime-threads`).
//!
//! One thread gets tokio's single-threaded scheduler, which runs woken tasks
//! in the order they were woken: when one read from a worker's connection
//! wakes the streams of several tokens, each stream task runs, and the
//! client connection's task, woken by the first of them, runs once after
//! them all and writes their frames in one `writev`. The multi-threaded
//! scheduler runs a task woken by the running one next (its LIFO slot), so
//! the connection task ran after every stream task: one write per token,
//! five times the router's syscalls at 20 streams (issue 20, BENCHMARKS.md
//! "The router's hop"). More threads get the multi-threaded scheduler.
use std::io;
use tokio::runtime::{Builder, Runtime};

/// The threads `requested` means: itself, or for 0 one per CPU this process
/// may run on (its affinity mask and cgroup quota, as
/// `std::thread::available_parallelism` reads them).
pub fn threads(requested: usize) -> usize {
    match requested {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// A runtime of `threads(requested)` threads, with I/O and timers.
pub fn build(requested: usize) -> io::Result<Runtime> {
    match threads(requested) {
        1 => Builder::new_current_thread().enable_all().build(),
        n => Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_means_the_cpus_this_process_may_use() {
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert_eq!(threads(0), cpus);
        assert_eq!(threads(3), 3);
    }

    #[test]
    fn one_thread_runs_everything_on_the_calling_thread() {
        let caller = std::thread::current().id();
        let rt = build(1).unwrap();
        let ran_on =
            rt.block_on(async { tokio::spawn(async { std::thread::current().id() }).await });
        assert_eq!(ran_on.unwrap(), caller);
        let rt = build(2).unwrap();
        let ran_on =
            rt.block_on(async { tokio::spawn(async { std::thread::current().id() }).await });
        assert_ne!(ran_on.unwrap(), caller);
    }
}
