//! The compute threads of the CPU kernels: a fork-join pool whose helpers
//! spin briefly between jobs.
//!
//! A decode step runs about 150 parallel regions (four projections and the
//! attention of each of 30 layers, then the output head), each only tens of
//! microseconds long for one sequence. A general pool (rayon) puts idle
//! threads to sleep within microseconds, so every region paid a futex wake-up
//! and a single stream lost about a third of its step to it. Here a helper
//! spins for a while after each job, so the next region of the same step
//! starts at once, and parks only when the engine has been idle that long.
use super::kernels::CpuKernels;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle helper spins before it yields, then parks.
const SPIN: Duration = Duration::from_micros(200);
const YIELD: Duration = Duration::from_millis(2);

/// The job being run: a task function and how many tasks.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
}

struct Shared {
    /// Generation of the current job; a change tells helpers to start.
    epoch: AtomicUsize,
    /// Written by `run` only while no helper reads it (see `pending`).
    job: UnsafeCell<Job>,
    /// Next task index to claim.
    next: AtomicUsize,
    /// Helpers that have not finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    /// A job is running: another `run` meanwhile (from a task, or from a
    /// second thread) runs its tasks on its own thread instead.
    busy: AtomicBool,
    stop: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the one `run` holding `busy`, while every
// helper has checked out of the previous job (`pending` is 0), and read by
// helpers only between seeing a new epoch and checking out; the function it
// points to is Sync.
unsafe impl Sync for Shared {}
// SAFETY: as for Sync; nothing in `Shared` is tied to the thread that made it.
unsafe impl Send for Shared {}

/// A fixed set of compute threads; the calling thread is one of them. It
/// also carries which kernels its tasks run, so every kernel entry point
/// (which takes the pool) reads the one choice made at load.
pub struct ComputePool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    kernels: CpuKernels,
}

impl ComputePool {
    /// A pool of `threads` compute threads in all (the caller and
    /// `threads - 1` helpers) running `kernels`.
    pub fn new(threads: usize, kernels: CpuKernels) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(Job {
                f: &(|_| {}) as &'static (dyn Fn(usize) + Sync),
                tasks: 0,
            }),
            next: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        let helpers = (1..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("cpu-kernels-{i}"))
                    .spawn(move || helper(&shared))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Self {
            shared,
            helpers,
            kernels,
        })
    }

    /// The kernels the tasks run.
    pub fn kernels(&self) -> CpuKernels {
        self.kernels
    }

    /// Compute threads, the caller included.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Runs `f(0) .. f(tasks - 1)` across the threads and returns when all
    /// are done. Tasks are claimed one at a time, so uneven ones balance.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        if self.helpers.is_empty() || tasks <= 1 || s.busy.swap(true, Ordering::Acquire) {
            (0..tasks).for_each(f);
            return;
        }
        // SAFETY: this call holds `busy`, no helper reads `job` now (the last
        // `run` waited for all of them to check out), and this call outlives
        // every use of `f`: it
        // returns only after every helper has checked out of this job.
        unsafe {
            *s.job.get() = Job {
                f: std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(
                    f,
                ),
                tasks,
            };
        }
        s.next.store(0, Ordering::Relaxed);
        s.pending.store(self.helpers.len(), Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        {
            // Parked helpers check the epoch under this lock before waiting,
            // so none misses the wake-up.
            let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| claim(s, f, tasks)));
        let started = Instant::now();
        while s.pending.load(Ordering::Acquire) != 0 {
            if started.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let helper_panicked = s.panicked.swap(false, Ordering::Relaxed);
        s.busy.store(false, Ordering::Release);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if helper_panicked {
            panic!("a compute thread panicked");
        }
    }
}

/// A raw pointer shared by the tasks of one job, each of which touches only
/// its own part of what it points to.
pub(super) struct Parts<T>(pub(super) *mut T);
impl<T> Clone for Parts<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Parts<T> {}
impl<T> Parts<T> {
    /// Through a method, so that closures capture the whole (Sync) wrapper.
    pub(super) fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: a `Parts` is only handed to tasks that each write a disjoint range
// of the buffer it points to, which outlives the pool job (see `rows`).
unsafe impl<T: Send> Send for Parts<T> {}
// SAFETY: as for Send: shared between tasks, used for disjoint writes only.
unsafe impl<T: Send> Sync for Parts<T> {}

impl ComputePool {
    /// Calls `f(i, row_i)` for every `width`-long row of `out`, rows spread
    /// over the threads.
    pub fn rows_mut<T: Send>(
        &self,
        out: &mut [T],
        width: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let rows = out.len() / width.max(1);
        if rows <= 1 {
            if rows == 1 {
                f(0, out);
            }
            return;
        }
        let per_task = rows.div_ceil(self.threads() * 2);
        let base = Parts(out.as_mut_ptr());
        self.run(rows.div_ceil(per_task), &|t| {
            for r in t * per_task..((t + 1) * per_task).min(rows) {
                // SAFETY: rows are disjoint and inside `out`; each is handed
                // to one task only.
                let row =
                    unsafe { std::slice::from_raw_parts_mut(base.get().add(r * width), width) };
                f(r, row);
            }
        });
    }
}

fn claim(s: &Shared, f: &(dyn Fn(usize) + Sync), tasks: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            return;
        }
        f(i);
    }
}

fn helper(s: &Shared) {
    let mut seen = 0;
    loop {
        let idle = Instant::now();
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            let waited = idle.elapsed();
            if waited < SPIN {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else if waited < YIELD {
                std::thread::yield_now();
            } else {
                let g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                if s.epoch.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Relaxed) {
                    drop(s.wake.wait(g).unwrap_or_else(|e| e.into_inner()));
                }
            }
        }
        // SAFETY: see `Shared`; `run` keeps the job alive until we check out.
        let job = unsafe { *s.job.get() };
        // SAFETY: `job.f` points at the closure `run` borrows for the job's life.
        let f = unsafe { &*job.f };
        if catch_unwind(AssertUnwindSafe(|| claim(s, f, job.tasks))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ComputePool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        {
            let _g = self.shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_per_job_across_many_jobs() {
        let pool = ComputePool::new(3, CpuKernels::default()).unwrap();
        let counts: Vec<AtomicUsize> = (0..97).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..500 {
            pool.run(counts.len(), &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        // Park the helpers, then run again: the wake-up is not lost.
        std::thread::sleep(YIELD * 3);
        pool.run(counts.len(), &|i| {
            counts[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 501));
    }

    #[test]
    fn nested_and_concurrent_runs_fall_back_to_their_own_thread() {
        let pool = ComputePool::new(2, CpuKernels::default()).unwrap();
        let n = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        pool.run(8, &|_| {
                            pool.run(4, &|_| {
                                n.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(n.load(Ordering::Relaxed), 2 * 200 * 8 * 4);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_after_the_job_ends() {
        let pool = ComputePool::new(2, CpuKernels::default()).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, &|i| {
                if i == 40 {
                    panic!("task 40");
                }
            })
        }));
        assert!(r.is_err());
        // The pool still works.
        let n = AtomicUsize::new(0);
        pool.run(10, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
