//! Reconnect backoff; the circuit breaker is every tier's (`kvoffload_tier::breaker`).

pub use kvoffload_tier::breaker::{Admit, Breaker, BreakerState};
use std::time::Duration;

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
