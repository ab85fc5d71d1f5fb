//! The store's internal invariants, checked in full for tests and debugging.

use super::entry::{State, LISTED, PROTECTED};
use super::Store;
use crate::error::{Error, Result};
use crate::policy::NO_LIST;

impl Store {
    /// Checks every internal invariant; `Error::BrokenInvariant` describes the first broken one
    /// (the store stays usable). For tests and debugging: O(slots used).
    pub fn check_invariants(&self) -> Result<()> {
        macro_rules! ensure {
            ($cond:expr, $($msg:tt)+) => {
                if !$cond {
                    return Err(Error::BrokenInvariant(format!($($msg)+)));
                }
            };
        }
        let (mut ready, mut pending, mut pinned) = (0, 0, 0);
        let mut live_slots = 0u32;
        for (slot, e) in self.entries.iter().enumerate() {
            let slot = slot as u32;
            match e.state {
                State::Free => {
                    ensure!(e.list == NO_LIST, "free slot {slot} is in a policy list");
                    ensure!(e.pins == 0, "free slot {slot} is pinned");
                    continue;
                }
                State::Pending => {
                    pending += u64::from(e.live());
                    ensure!(e.pins == 0, "pending slot {slot} is pinned");
                }
                State::Ready => ready += u64::from(e.live()),
            }
            ensure!(e.flags & PROTECTED == 0, "slot {slot} left protected");
            ensure!(e.flags & LISTED == 0, "slot {slot} left marked as listed");
            live_slots += 1;
            pinned += u64::from(e.pins > 0 && e.live());
            ensure!(
                self.find_key(e.key.as_slice()) == Some(slot),
                "slot {slot} is not indexed"
            );
            ensure!(e.list != NO_LIST, "slot {slot} is in no policy list");
        }
        ensure!(self.index.len() as u32 == live_slots, "index size");
        let mut free = self.free.clone();
        free.sort_unstable();
        free.dedup();
        ensure!(free.len() == self.free.len(), "a slot is free twice");
        for &s in &free {
            ensure!(
                s < self.used_high_mark() && self.entries[s as usize].state == State::Free,
                "free slot {s} is in use"
            );
        }
        ensure!(
            live_slots + free.len() as u32 == self.used_high_mark(),
            "slots lost"
        );
        ensure!(
            self.used_high_mark() <= self.usable && self.usable <= self.num_slots,
            "slots handed out past the usable {} (of {})",
            self.usable,
            self.num_slots
        );
        ensure!(
            (ready, pending, pinned) == (self.stats.ready, self.stats.pending, self.stats.pinned),
            "counters: ready, pending, pinned are {:?}, counted {:?}",
            (ready, pending, pinned),
            (self.stats.ready, self.stats.pending, self.stats.pinned)
        );
        let mut in_lists = 0;
        for list in 0..self.policy.num_lists() {
            let members = self.policy.list_members(&self.entries, list);
            ensure!(
                members.len() as u32 == self.policy.list_len(list),
                "list {list} length"
            );
            for s in members {
                ensure!(
                    self.entries[s as usize].list == list,
                    "slot {s} in the wrong list"
                );
            }
            in_lists += self.policy.list_len(list);
        }
        ensure!(
            in_lists == live_slots,
            "policy lists hold every live slot once"
        );
        if let Some(s) = self.policy.rank_mismatch(&self.entries) {
            ensure!(false, "slot {s} is ordered by a stale rank");
        }
        if let Some(problem) = self.policy.ghost_problem() {
            ensure!(false, "{problem}");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::error::Error;
    use crate::policy::PolicyKind;
    use crate::store::Store;

    #[test]
    fn a_broken_invariant_is_an_error_and_the_store_stays_usable() {
        let mut s = Store::new(4, PolicyKind::Lru, false).unwrap();
        s.prepare_store(&[b"a"]).unwrap().unwrap();
        s.stats.ready += 1; // a counting bug
        let err = s.check_invariants().unwrap_err();
        assert!(matches!(&err, Error::BrokenInvariant(m) if m.starts_with("counters")));
        s.stats.ready -= 1;
        s.complete_store(&[b"a"], true).unwrap();
        s.check_invariants().unwrap();
    }
}
