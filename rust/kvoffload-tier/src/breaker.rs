//! The circuit breaker every tier shares: after `threshold` failures in a row the tier is down
//! for `cooldown` (every job fails fast, with no I/O), then one job probes it.

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
}
