//! The completions of a tier's jobs and how its caller takes them: one lock over the tier's job
//! state (its queues, what runs, the completions not taken yet), and the condition `wait` and
//! `drain` sleep on. Each tier keeps its own job state; what is done and what counts as idle is
//! all this needs to know of it ([`JobState`]).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The outcome of one job: one status byte per item ([`crate::status`]), in submission order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub job_id: u64,
    pub statuses: Vec<u8>,
}

/// What a tier keeps under its queue's lock.
pub trait JobState {
    /// The completions the caller has not taken yet.
    fn done(&mut self) -> &mut Vec<Completion>;
    /// Whether no job is in flight: what `drain` waits for.
    fn idle(&self) -> bool;
}

/// A tier's job state `Q` under its lock, and the condition its caller waits on.
pub struct CompletionQueue<Q> {
    state: Mutex<Q>,
    done_cv: Condvar,
}

impl<Q: JobState> CompletionQueue<Q> {
    pub fn new(state: Q) -> Self {
        CompletionQueue {
            state: Mutex::new(state),
            done_cv: Condvar::new(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Q> {
        // Nobody panics while holding the lock with the queues half-updated.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes `wait` and `drain`: call it with the lock released, after a completion was added or
    /// a job left.
    pub fn notify(&self) {
        self.done_cv.notify_all();
    }

    /// Adds `c` under the lock `q` holds, releases it and wakes `wait` and `drain`.
    pub fn complete(&self, mut q: MutexGuard<'_, Q>, c: Completion) {
        q.done().push(c);
        drop(q);
        self.notify();
    }

    /// The completions ready now.
    pub fn poll(&self) -> Vec<Completion> {
        std::mem::take(self.lock().done())
    }

    /// Waits until at least one completion is ready, or `timeout`; returns every one there is.
    pub fn wait(&self, timeout: Duration) -> Vec<Completion> {
        self.wait_until(timeout, |q| !q.done().is_empty())
    }

    /// Waits until no job is in flight, or `timeout`; returns every completion there is.
    pub fn drain(&self, timeout: Duration) -> Vec<Completion> {
        self.wait_until(timeout, |q| q.idle())
    }

    fn wait_until(&self, timeout: Duration, ready: impl Fn(&mut Q) -> bool) -> Vec<Completion> {
        // A timeout past what an `Instant` can hold waits without end, an hour at a time.
        let end = Instant::now().checked_add(timeout);
        let mut q = self.lock();
        while !ready(&mut q) {
            let left = match end {
                Some(end) => end.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                break;
            }
            q = self
                .done_cv
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        std::mem::take(q.done())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Default)]
    struct Jobs {
        done: Vec<Completion>,
        running: usize,
    }

    impl JobState for Jobs {
        fn done(&mut self) -> &mut Vec<Completion> {
            &mut self.done
        }
        fn idle(&self) -> bool {
            self.running == 0
        }
    }

    fn finished(id: u64) -> Completion {
        Completion {
            job_id: id,
            statuses: vec![0],
        }
    }

    #[test]
    fn wait_returns_at_a_completion_and_drain_when_idle() {
        let q = Arc::new(CompletionQueue::new(Jobs::default()));
        assert!(q.wait(Duration::from_millis(10)).is_empty());
        q.lock().running = 2;
        let worker = {
            let q = Arc::clone(&q);
            std::thread::spawn(move || {
                for id in 1..=2 {
                    std::thread::sleep(Duration::from_millis(20));
                    let mut g = q.lock();
                    g.running -= 1;
                    q.complete(g, finished(id));
                }
            })
        };
        let mut got = q.wait(Duration::from_secs(10));
        assert!(!got.is_empty());
        got.extend(q.drain(Duration::from_secs(10)));
        assert_eq!(got, vec![finished(1), finished(2)]);
        assert!(q.lock().idle());
        worker.join().unwrap();
        assert!(q.poll().is_empty());
        // Idle: drain returns at once, whatever the timeout.
        assert!(q.drain(Duration::MAX).is_empty());
    }
}
