//! ARC against the published algorithm: Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead
//! Replacement Cache" (FAST 2003), Fig. 4, written out plainly below. Driven one key per call
//! (a hit is a load's `touch`, a miss a store), the store must hold the same T1 and T2, in the
//! same order, with the same target, after every access.

use kvoffload_core::{PolicyKind, Store};
use proptest::prelude::*;
use std::collections::VecDeque;

struct PaperArc {
    c: usize,
    p: f64,
    t1: VecDeque<u8>,
    t2: VecDeque<u8>,
    b1: VecDeque<u8>,
    b2: VecDeque<u8>,
}

fn take(list: &mut VecDeque<u8>, x: u8) -> bool {
    match list.iter().position(|&k| k == x) {
        Some(i) => {
            list.remove(i);
            true
        }
        None => false,
    }
}

impl PaperArc {
    fn new(c: usize) -> Self {
        PaperArc {
            c,
            p: 0.0,
            t1: VecDeque::new(),
            t2: VecDeque::new(),
            b1: VecDeque::new(),
            b2: VecDeque::new(),
        }
    }

    fn replace(&mut self, x_in_b2: bool) {
        let t1 = self.t1.len() as f64;
        if !self.t1.is_empty() && (t1 > self.p || (x_in_b2 && t1 == self.p)) {
            let k = self.t1.pop_front().unwrap();
            self.b1.push_back(k);
        } else if let Some(k) = self.t2.pop_front() {
            self.b2.push_back(k);
        } else {
            // T2 empty: only T1 can give (the paper leaves this case implicit).
            let k = self.t1.pop_front().unwrap();
            self.b1.push_back(k);
        }
    }

    /// Returns whether `x` was a hit.
    fn access(&mut self, x: u8) -> bool {
        // Case I: a hit.
        if take(&mut self.t1, x) || take(&mut self.t2, x) {
            self.t2.push_back(x);
            return true;
        }
        let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
        if self.b1.contains(&x) {
            // Case II.
            let delta = if b1 >= b2 { 1.0 } else { b2 / b1 };
            self.p = (self.p + delta).min(self.c as f64);
            self.replace(false);
            take(&mut self.b1, x);
            self.t2.push_back(x);
        } else if self.b2.contains(&x) {
            // Case III.
            let delta = if b2 >= b1 { 1.0 } else { b1 / b2 };
            self.p = (self.p - delta).max(0.0);
            self.replace(true);
            take(&mut self.b2, x);
            self.t2.push_back(x);
        } else {
            // Case IV.
            let l1 = self.t1.len() + self.b1.len();
            let total = l1 + self.t2.len() + self.b2.len();
            if l1 == self.c {
                if self.t1.len() < self.c {
                    self.b1.pop_front();
                    self.replace(false);
                } else {
                    self.t1.pop_front();
                }
            } else if total >= self.c {
                if total == 2 * self.c {
                    self.b2.pop_front();
                }
                self.replace(false);
            }
            self.t1.push_back(x);
        }
        false
    }
}

fn drive(c: usize, accesses: &[u8]) {
    let mut store = Store::new(c as i64, PolicyKind::Arc, false).unwrap();
    let mut paper = PaperArc::new(c);
    for (step, &x) in accesses.iter().enumerate() {
        let key = [x];
        let hit = paper.access(x);
        let status = store.lookup(&[key]).unwrap()[0];
        assert_eq!(
            status == kvoffload_core::KeyStatus::Ready,
            hit,
            "step {step}: key {x} hit"
        );
        if hit {
            store.touch(&[key], true).unwrap();
        } else {
            store.prepare_store(&[key]).unwrap().expect("room is made");
            store.complete_store(&[key], true).unwrap();
        }
        let order = store.recency_order();
        let t1: Vec<u8> = order[0].iter().map(|k| k[0]).collect();
        let t2: Vec<u8> = order[1].iter().map(|k| k[0]).collect();
        assert_eq!(t1, Vec::from(paper.t1.clone()), "step {step}: T1 after {x}");
        assert_eq!(t2, Vec::from(paper.t2.clone()), "step {step}: T2 after {x}");
        assert_eq!(store.stats().arc_target_t1, paper.p, "step {step}: target");
        assert!(paper.t1.len() + paper.b1.len() <= c);
        assert!(paper.t1.len() + paper.t2.len() + paper.b1.len() + paper.b2.len() <= 2 * c);
        store.check_invariants().unwrap();
    }
}

#[test]
fn a_scan_then_a_loop() {
    let mut accesses: Vec<u8> = (0..4).cycle().take(12).collect();
    accesses.extend(20..40);
    accesses.extend((0..4).cycle().take(12));
    accesses.extend((40..48).cycle().take(40));
    drive(6, &accesses);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn matches_the_paper(c in 1usize..8, accesses in prop::collection::vec(0u8..24, 1..400)) {
        drive(c, &accesses);
    }

    /// Skewed traffic reaches the ghost lists and both adaptation directions more often.
    #[test]
    fn matches_the_paper_on_skewed_traffic(
        c in 2usize..10,
        accesses in prop::collection::vec((0u8..4, 0u8..40), 1..600),
    ) {
        let keys: Vec<u8> = accesses.iter().map(|&(hot, k)| if hot == 0 { k } else { k % 6 }).collect();
        drive(c, &keys);
    }
}
