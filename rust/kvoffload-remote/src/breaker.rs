//! The circuit breaker (fail fast while the server is down) and reconnect backoff.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Up,
    Down,
    HalfOpen,
}

impl BreakerState {
    pub fn name(self) -> &'static str {
        match self {
            BreakerState::Up => "up",
            BreakerState::Down => "down",
            BreakerState::HalfOpen => "half-open",
        }
    }
}

/// What a job may do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    Run,
    /// Run as the one trial job of the half-open state.
    Probe,
    Deny,
}

struct Inner {
    consecutive: u32,
    open_until: Option<Instant>,
    probing: bool,
}

pub struct Breaker {
    inner: Mutex<Inner>,
    threshold: u32,
    cooldown: Duration,
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Breaker {
        Breaker {
            inner: Mutex::new(Inner {
                consecutive: 0,
                open_until: None,
                probing: false,
            }),
            threshold,
            cooldown,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The state is a few plain fields, valid whatever a panicking holder was doing.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn state(&self) -> BreakerState {
        let g = self.lock();
        match g.open_until {
            None => BreakerState::Up,
            Some(t) if Instant::now() < t => BreakerState::Down,
            Some(_) => BreakerState::HalfOpen,
        }
    }

    pub fn admit(&self) -> Admit {
        let mut g = self.lock();
        match g.open_until {
            None => Admit::Run,
            Some(t) if Instant::now() < t => Admit::Deny,
            Some(_) if g.probing => Admit::Deny,
            Some(_) => {
                g.probing = true;
                Admit::Probe
            }
        }
    }

    pub fn success(&self) {
        let mut g = self.lock();
        g.consecutive = 0;
        g.open_until = None;
        g.probing = false;
    }

    /// Records a job-level failure; true when this opened the breaker.
    pub fn failure(&self, probe: bool) -> bool {
        let mut g = self.lock();
        if probe {
            g.probing = false;
            g.open_until = Some(Instant::now() + self.cooldown);
            return true;
        }
        g.consecutive = g.consecutive.saturating_add(1);
        if g.consecutive >= self.threshold && g.open_until.is_none() {
            g.open_until = Some(Instant::now() + self.cooldown);
            return true;
        }
        false
    }

    /// Opens the breaker at once (the server was unreachable at start-up).
    pub fn trip(&self) {
        let mut g = self.lock();
        g.consecutive = self.threshold;
        g.open_until = Some(Instant::now() + self.cooldown);
    }
}

/// Jittered exponential backoff between reconnect attempts of one worker.
pub struct Backoff {
    next: Duration,
    rng: u64,
}

const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

impl Backoff {
    pub fn new(seed: u64) -> Backoff {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Backoff {
            next: BACKOFF_MIN,
            // xorshift must not start at zero.
            rng: (t ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1,
        }
    }

    pub fn reset(&mut self) {
        self.next = BACKOFF_MIN;
    }

    /// The wait before the next attempt: the current step ±50%, then the step doubles.
    pub fn next_delay(&mut self) -> Duration {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let frac = (self.rng % 1001) as f64 / 1000.0; // 0..=1
        let d = self.next.mul_f64(0.5 + frac);
        self.next = (self.next * 2).min(BACKOFF_MAX);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_probes_once() {
        let b = Breaker::new(2, Duration::from_millis(30));
        assert_eq!(b.admit(), Admit::Run);
        assert!(!b.failure(false));
        assert!(b.failure(false));
        assert_eq!(b.state(), BreakerState::Down);
        assert_eq!(b.admit(), Admit::Deny);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(b.admit(), Admit::Probe);
        assert_eq!(b.admit(), Admit::Deny);
        assert!(b.failure(true));
        assert_eq!(b.state(), BreakerState::Down);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.admit(), Admit::Probe);
        b.success();
        assert_eq!(b.state(), BreakerState::Up);
        assert_eq!(b.admit(), Admit::Run);
    }

    #[test]
    fn backoff_grows_with_jitter_and_caps() {
        let mut b = Backoff::new(1);
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(25) && first <= Duration::from_millis(75));
        for _ in 0..10 {
            b.next_delay();
        }
        let d = b.next_delay();
        assert!(
            d >= Duration::from_millis(500) && d <= Duration::from_millis(1500),
            "{d:?}"
        );
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(75));
    }
}
