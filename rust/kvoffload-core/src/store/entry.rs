//! One slot's entry: its key, its state and the flags and pins that keep it from eviction.

use crate::key::InlineKey;
use crate::list::{Linked, NIL};
use crate::policy::{PolicyNode, Rank, NO_LIST};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum KeyStatus {
    Absent = 0,
    Pending = 1,
    Ready = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Free,
    Pending,
    Ready,
}

/// Set by `reset` on a key that cannot go yet (pending or pinned): it answers as absent and is
/// dropped when released.
pub(super) const DOOMED: u8 = 1;
/// Set during one `prepare_store` on ready keys of that call, so they are not evicted for it.
pub(super) const PROTECTED: u8 = 2;
/// Set for the length of one call on the keys it lists, to find a key listed twice.
pub(super) const LISTED: u8 = 4;

/// One write hold, counted in the top 4 bits of `pins`: a write to a secondary tier reads the
/// slot (one hold per tier of a chain). It keeps the key from eviction as a load pin does, but
/// it is not a load (`first_pinned` does not see it).
pub(super) const WRITE_HOLD: u32 = 1 << 28;
/// The write holds: at most 15 at a time.
pub(super) const WRITE_HOLDS: u32 = 0xF << 28;
/// The load pins, below the write holds.
pub(super) const LOAD_PINS: u32 = WRITE_HOLD - 1;

#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) key: InlineKey,
    pub(super) state: State,
    pub(super) flags: u8,
    pub(super) list: u8,
    pub(super) pins: u32,
    pub(super) prev: u32,
    pub(super) next: u32,
}

impl Entry {
    pub(super) const FREE: Entry = Entry {
        key: InlineKey::EMPTY,
        state: State::Free,
        flags: 0,
        list: NO_LIST,
        pins: 0,
        prev: NIL,
        next: NIL,
    };

    pub(super) fn live(&self) -> bool {
        self.flags & DOOMED == 0
    }

    pub(super) fn status(&self) -> KeyStatus {
        match self.state {
            _ if !self.live() => KeyStatus::Absent,
            State::Free => KeyStatus::Absent,
            State::Pending => KeyStatus::Pending,
            State::Ready => KeyStatus::Ready,
        }
    }

    pub(super) fn state_name(&self) -> &'static str {
        match (self.state, self.live(), self.pins) {
            (State::Free, _, _) => "absent",
            (_, false, _) => "absent (reset)",
            (State::Pending, _, _) => "pending",
            (State::Ready, _, 0) => "ready",
            (State::Ready, _, _) => "ready and pinned",
        }
    }
}

impl Linked for Entry {
    fn prev(&self) -> u32 {
        self.prev
    }
    fn next(&self) -> u32 {
        self.next
    }
    fn set_prev(&mut self, v: u32) {
        self.prev = v;
    }
    fn set_next(&mut self, v: u32) {
        self.next = v;
    }
}

impl PolicyNode for Entry {
    fn list(&self) -> u8 {
        self.list
    }
    fn set_list(&mut self, list: u8) {
        self.list = list;
    }
    // LRU keeps no links: the rank takes their 8 bytes.
    fn rank(&self) -> Rank {
        Rank::from_bits((u64::from(self.prev) << 32) | u64::from(self.next))
    }
    fn set_rank(&mut self, rank: Rank) {
        let bits = rank.to_bits();
        self.prev = (bits >> 32) as u32;
        self.next = bits as u32;
    }
}
