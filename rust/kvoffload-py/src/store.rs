//! `Store`: the CPU-tier block store, one core call per batch with the GIL released.

use crate::errors::{to_py, KVOffloadError};
use crate::keys::{bytes_list, i64_bytes, int64_bytes, new_bytes, KeyArg, KeyList};
use crate::window::{group_rules, load_tables, offered, GroupSpec, Offer};
use kvoffload_core::{
    group_load, lookup_groups, used_keys, Error, EventKind, GroupLoadAsk, GroupStoreOffer, KeyBuf,
    LookupAsk, LookupGroup, PolicyKind, Positions, RankedBatch,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};
use std::sync::{Mutex, MutexGuard};

/// What `offer_group_store` answers for an accepted offer: the keys to write, then their slots,
/// chunks and GPU blocks (int64 bytes), the keys per group and the live blocks of window groups.
type GroupStoreAnswer<'py> = (
    KeyList,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<u32>,
    Vec<u64>,
);

/// What `load_groups` answers: the keys, their slots and the GPU blocks written (int64 bytes),
/// and each loading group's `(group, num_slots, num_blocks, skip_leading_blocks)`.
type GroupLoadAnswer<'py> = (
    KeyList,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<(u32, u64, u64, u64)>,
);

/// The CPU-tier block store. Thread-safe: every call takes an internal lock, with the GIL released
/// while it waits for the lock and while the store works.
#[pyclass(frozen, module = "kvoffload._rust")]
pub struct Store {
    inner: Mutex<kvoffload_core::Store>,
    num_slots: u32,
    policy: &'static str,
    events_enabled: bool,
}

impl Store {
    fn lock(&self) -> PyResult<MutexGuard<'_, kvoffload_core::Store>> {
        self.inner.lock().map_err(|_| {
            KVOffloadError::new_err("the store is unusable: an earlier call panicked inside it")
        })
    }

    /// Runs `f` on the store with the GIL released; `f` returns owned data, so Python objects
    /// are built after the lock is let go.
    fn detached<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut kvoffload_core::Store) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        py.detach(|| f(&mut *self.lock()?).map_err(to_py))
    }

    /// Runs `f` on the store and the keys with the GIL released.
    fn with_keys<T: Send>(
        &self,
        py: Python<'_>,
        keys: &KeyArg<'_>,
        f: impl FnOnce(&mut kvoffload_core::Store, &[&[u8]]) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        keys.run(py, |k| f(&mut *self.lock()?, k).map_err(to_py))
    }
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (num_slots, eviction_policy = "lru", enable_events = false, usable_slots = None))]
    fn new(
        num_slots: i64,
        eviction_policy: &str,
        enable_events: bool,
        usable_slots: Option<i64>,
    ) -> PyResult<Self> {
        let policy: PolicyKind = eviction_policy.parse().map_err(to_py)?;
        let mut store =
            kvoffload_core::Store::new(num_slots, policy, enable_events).map_err(to_py)?;
        if let Some(usable) = usable_slots {
            store = store.with_usable_slots(usable).map_err(to_py)?;
        }
        Ok(Store {
            num_slots: store.num_slots(),
            policy: store.policy().name(),
            events_enabled: store.events_enabled(),
            inner: Mutex::new(store),
        })
    }

    #[getter]
    fn num_slots(&self) -> u32 {
        self.num_slots
    }

    #[getter]
    fn usable_slots(&self, py: Python<'_>) -> PyResult<u32> {
        self.detached(py, |s| Ok(s.usable_slots()))
    }

    fn set_usable_slots(&self, py: Python<'_>, usable: i64) -> PyResult<()> {
        self.detached(py, |s| s.set_usable_slots(usable))
    }

    #[getter]
    fn eviction_policy(&self) -> &'static str {
        self.policy
    }

    #[getter]
    fn events_enabled(&self) -> bool {
        self.events_enabled
    }

    /// `None` when the store cannot take the keys now; else `(keys_to_write, indices, slots,
    /// evicted_keys)`: `keys_to_write` is a list of bytes (a `KeyList` when a `KeyList` or
    /// view was offered), `indices` their positions in the offer and `slots` their
    /// slots (both int64 bytes).
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (keys, rank = None, first_position = 0, positions = None, partial = false))]
    fn prepare_store<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        rank: Option<u64>,
        first_position: i64,
        positions: Option<&Bound<'py, PyAny>>,
        partial: bool,
    ) -> PyResult<
        Option<(
            Bound<'py, PyAny>,
            Bound<'py, PyBytes>,
            Bound<'py, PyBytes>,
            Bound<'py, PyList>,
        )>,
    > {
        let arg = KeyArg::extract(keys)?;
        let positions = positions.map(extract_positions).transpose()?;
        let batch = ranked(rank, first_position, positions.as_deref());
        let Some(plan) =
            self.with_keys(py, &arg, |s, k| s.prepare_store_ranked(k, batch, partial))?
        else {
            return Ok(None);
        };
        let answer = (|| -> PyResult<_> {
            Ok((
                arg.select(py, &plan.indices)?,
                int64_bytes(py, &plan.indices)?,
                int64_bytes(py, &plan.slots)?,
                bytes_list(py, plan.evicted.iter())?,
            ))
        })();
        if let Err(err) = answer {
            // Out of memory for the answer: the caller will never complete these stores, so
            // undo them (as failed) rather than leave the keys pending forever.
            let undone = self.with_keys(py, &arg, |s, k| {
                let new: Vec<&[u8]> = plan.indices.iter().map(|&i| k[i as usize]).collect();
                s.complete_store(&new, false)
            });
            if let Err(undo_err) = undone {
                err.set_cause(py, Some(undo_err));
            }
            return Err(err);
        }
        answer.map(Some)
    }

    /// A hybrid model's store of one request: the chunks `offers` offer (`group_offer`), planned
    /// in one call. Each group's offered chunks that no other store is writing now are a use of
    /// them, flagged in its `used` (one byte per chunk, grown as needed). `None` when the store
    /// cannot take the keys now, else `(keys_to_write, slots, chunks, blocks, counts,
    /// window_blocks)`: `slots`, `chunks` and `blocks` (the GPU blocks each key is read from, by
    /// its offer's table) int64 bytes, `counts` the keys per group, `window_blocks` the live
    /// blocks of `windowed` groups among `blocks`.
    #[allow(clippy::too_many_arguments)]
    fn offer_group_store<'py>(
        &self,
        py: Python<'py>,
        offers: Vec<Offer<'py>>,
        blocks_per_chunk: usize,
        num_groups: u32,
        rank: u64,
        windowed: Vec<bool>,
        used: Vec<Bound<'py, PyByteArray>>,
    ) -> PyResult<Option<GroupStoreAnswer<'py>>> {
        if used.len() != num_groups as usize {
            return Err(PyValueError::new_err(format!(
                "used has {} flag arrays: expected one per group ({num_groups})",
                used.len()
            )));
        }
        let (batch, tables) = offered(&offers, blocks_per_chunk, num_groups)?;
        let tables: Vec<(u64, &[u64])> = tables.iter().map(|(c, t)| (*c, t.as_slice())).collect();
        let offer = GroupStoreOffer {
            batch: &batch,
            tables: &tables,
            windowed: &windowed,
            blocks_per_chunk,
            rank,
        };
        let outcome = self.detached(py, |s| s.offer_group_store(&offer))?;
        for (flags, chunks) in used.iter().zip(&outcome.used) {
            mark_used(flags, chunks)?;
        }
        let Some(plan) = outcome.plan else {
            return Ok(None);
        };
        let answer = (|| -> PyResult<_> {
            Ok((
                int64_bytes(py, &plan.slots)?,
                i64_bytes(py, plan.chunks.iter().map(|&c| c as i64))?,
                i64_bytes(py, plan.blocks.blocks.iter().map(|&b| b as i64))?,
            ))
        })();
        match answer {
            Ok((slots, chunks, blocks)) => Ok(Some((
                KeyList::from_buf(plan.keys),
                slots,
                chunks,
                blocks,
                plan.blocks.counts,
                plan.blocks.window_blocks,
            ))),
            Err(err) => {
                // As in `prepare_store`: undo the stores the caller will never complete.
                if let Err(undo_err) = self
                    .lock()
                    .and_then(|mut s| s.withdraw_group_store(&plan).map_err(to_py))
                {
                    err.set_cause(py, Some(undo_err));
                }
                Err(err)
            }
        }
    }

    #[pyo3(signature = (keys, success = true))]
    fn complete_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        self.with_keys(py, &KeyArg::extract(keys)?, |s, k| {
            s.complete_store(k, success)
        })
    }

    fn lookup_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<(usize, bool)> {
        self.with_keys(py, &KeyArg::extract(keys)?, |s, k| s.lookup_prefix(k))
    }

    /// A hybrid model's lookup of one request (`kvoffload_core::lookup_groups`): per group its
    /// keys and its `(kind, window_chunks, window, extra_retained_tokens, eagle)`.
    #[allow(clippy::too_many_arguments)]
    fn lookup_groups(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, KeyList>>,
        specs: Vec<GroupSpec>,
        tokens_per_chunk: u64,
        num_local: u64,
        num_tokens: u64,
        max_load_tokens: Option<u64>,
        loads_in_flight: bool,
    ) -> PyResult<Option<u64>> {
        let rules = group_rules(&specs, keys.len())?;
        let lists: Vec<&KeyList> = keys.iter().map(|k| k.get()).collect();
        let ask = LookupAsk {
            num_local,
            num_tokens,
            max_load_tokens,
            loads_in_flight,
        };
        py.detach(|| {
            let guards = lists
                .iter()
                .map(|l| l.read())
                .collect::<PyResult<Vec<_>>>()?;
            let groups: Vec<LookupGroup<'_>> = guards
                .iter()
                .zip(rules)
                .map(|(keys, rule)| LookupGroup { keys, rule })
                .collect();
            lookup_groups(&mut *self.lock()?, &groups, tokens_per_chunk, ask).map_err(to_py)
        })
    }

    fn first_pinned(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.with_keys(py, &KeyArg::extract(keys)?, |s, k| s.first_pinned(k))
    }

    /// One status byte per key: 0 absent, 1 pending, 2 ready.
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let statuses = self.with_keys(py, &KeyArg::extract(keys)?, |s, k| s.lookup(k))?;
        let raw: Vec<u8> = statuses.into_iter().map(|s| s as u8).collect();
        new_bytes(py, &raw)
    }

    #[pyo3(signature = (keys, rank = None, first_position = 0, positions = None))]
    fn prepare_load<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        rank: Option<u64>,
        first_position: i64,
        positions: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let positions = positions.map(extract_positions).transpose()?;
        let batch = ranked(rank, first_position, positions.as_deref());
        let slots = self.with_keys(py, &KeyArg::extract(keys)?, |s, k| {
            s.prepare_load_ranked(k, batch)
        })?;
        int64_bytes(py, &slots)
    }

    /// A hybrid model's load (`kvoffload_core::group_load`), pinned in request `rank`'s eviction
    /// order (and, with `touch`, used again: ARC's frequent list); each loading group's chunks
    /// are flagged in its `used`. Raises with nothing pinned when a key is not ready.
    #[allow(clippy::too_many_arguments)]
    fn load_groups<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Bound<'py, KeyList>>,
        tables: Vec<Bound<'py, PyList>>,
        first_block: usize,
        num_blocks: usize,
        end_chunk: u64,
        blocks_per_chunk: u64,
        rank: u64,
        used: Vec<Bound<'py, PyByteArray>>,
        touch: bool,
    ) -> PyResult<GroupLoadAnswer<'py>> {
        if used.len() != keys.len() {
            return Err(PyValueError::new_err(format!(
                "used has {} flag arrays: expected one per group ({})",
                used.len(),
                keys.len()
            )));
        }
        let blocks = load_tables(
            keys.len(),
            &tables,
            first_block,
            num_blocks,
            end_chunk,
            blocks_per_chunk,
        )?;
        let load = {
            let guards = keys
                .iter()
                .map(|k| k.get().read())
                .collect::<PyResult<Vec<_>>>()?;
            let key_bufs: Vec<&KeyBuf> = guards.iter().map(|g| &**g).collect();
            let block_refs: Vec<&[u64]> = blocks.iter().map(Vec::as_slice).collect();
            group_load(&GroupLoadAsk {
                keys: &key_bufs,
                blocks: &block_refs,
                first_block: first_block as u64,
                num_blocks: num_blocks as u64,
                end_chunk,
                blocks_per_chunk,
            })
            .map_err(to_py)?
        };
        // Grown (with zeros: no flag) before anything is pinned, the usual way flagging fails.
        for part in &load.parts {
            grow_used(
                &used[part.group as usize],
                usize::try_from(end_chunk).unwrap_or(usize::MAX),
            )?;
        }
        let slots = self.detached(py, |s| s.pin_group_load(&load, rank, touch))?;
        let flagged = load.parts.iter().try_for_each(|part| {
            let chunks: Vec<u64> = part.chunks.clone().collect();
            mark_used(&used[part.group as usize], &chunks)
        });
        if let Err(err) = flagged {
            // Another thread resized a flag array meanwhile: the caller gets no job to complete.
            if let Err(undo) = self.detached(py, |s| s.unpin_group_load(&load)) {
                err.set_cause(py, Some(undo));
            }
            return Err(err);
        }
        let parts = load
            .parts
            .iter()
            .map(|p| (p.group, p.num_slots(), p.num_blocks, p.skip_leading_blocks))
            .collect();
        Ok((
            KeyList::from_buf(load.batch.keys),
            int64_bytes(py, &slots)?,
            i64_bytes(py, load.gpu_blocks.iter().map(|&b| b as i64))?,
            parts,
        ))
    }

    fn new_rank(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.lock().map(|mut s| s.new_rank()))
    }

    fn complete_load(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_keys(py, &KeyArg::extract(keys)?, |s, k| s.complete_load(k))
    }

    fn hold_for_write<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let slots = self.with_keys(py, &KeyArg::extract(keys)?, |s, k| s.hold_for_write(k))?;
        int64_bytes(py, &slots)
    }

    fn release_write(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_keys(py, &KeyArg::extract(keys)?, |s, k| s.release_write(k))
    }

    /// `touch` of the keys each group's `used` flags (see `offer_group_store`), by chunk, then
    /// group: how vLLM refreshes a finished request's keys.
    #[pyo3(signature = (groups, reuse = true))]
    fn touch_group_used(
        &self,
        py: Python<'_>,
        groups: Vec<(Bound<'_, KeyList>, Bound<'_, PyByteArray>)>,
        reuse: bool,
    ) -> PyResult<()> {
        let flags: Vec<Vec<u8>> = groups.iter().map(|(_, used)| used.to_vec()).collect();
        let guards = groups
            .iter()
            .map(|(keys, _)| keys.get().read())
            .collect::<PyResult<Vec<_>>>()?;
        let parts: Vec<(&KeyBuf, &[u8])> = guards
            .iter()
            .zip(&flags)
            .map(|(keys, used)| (&**keys, used.as_slice()))
            .collect();
        let keys = used_keys(&parts).map_err(to_py)?;
        py.detach(|| self.lock()?.touch(&keys, reuse).map_err(to_py))
    }

    #[pyo3(signature = (keys, reuse = true))]
    fn touch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, reuse: bool) -> PyResult<()> {
        self.with_keys(py, &KeyArg::extract(keys)?, |s, k| s.touch(k, reuse))
    }

    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().map(|mut s| s.reset()))
    }

    /// `[(kind, keys)]` with kind `"stored"` or `"removed"`, oldest first.
    fn take_events<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(&'static str, Bound<'py, PyList>)>> {
        let events = self.detached(py, |s| Ok(s.take_events()))?;
        events
            .iter()
            .map(|e| {
                let kind = match e.kind {
                    EventKind::Stored => "stored",
                    EventKind::Removed => "removed",
                };
                Ok((kind, bytes_list(py, e.keys.iter())?))
            })
            .collect()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.detached(py, |s| Ok(s.stats()))?;
        let d = PyDict::new(py);
        d.set_item("num_slots", st.num_slots)?;
        d.set_item("usable_slots", st.usable_slots)?;
        d.set_item("used_slots", st.used_slots)?;
        d.set_item("ready", st.ready)?;
        d.set_item("pending", st.pending)?;
        d.set_item("pinned", st.pinned)?;
        d.set_item("hits", st.hits)?;
        d.set_item("misses", st.misses)?;
        d.set_item("evictions", st.evictions)?;
        d.set_item("store_refusals", st.store_refusals)?;
        d.set_item("stores_completed", st.stores_completed)?;
        d.set_item("stores_failed", st.stores_failed)?;
        d.set_item("metadata_bytes_per_slot", st.metadata_bytes_per_slot)?;
        d.set_item("arc_target_t1", st.arc_target_t1)?;
        Ok(d)
    }

    /// Keys from least to most recently used, one list per policy list (T1, T2 under ARC).
    fn recency_order<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyList>>> {
        let order = self.detached(py, |s| Ok(s.recency_order()))?;
        order.iter().map(|l| bytes_list(py, l)).collect()
    }

    /// Verifies every internal invariant; raises `KVOffloadError` on the first broken one.
    /// O(slots used).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.detached(py, |s| s.check_invariants())
    }
}

fn extract_positions(positions: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(raw) = positions.cast::<PyBytes>() {
        // An int64 array's bytes (numpy's `tobytes()`): no Python int per key.
        let raw = raw.as_bytes();
        if raw.len() % 8 != 0 {
            return Err(PyValueError::new_err(format!(
                "positions has {} bytes: expected int64 values (a multiple of 8 bytes)",
                raw.len()
            )));
        }
        return Ok(raw
            .chunks_exact(8)
            .map(|b| i64::from_ne_bytes(b.try_into().expect("8 bytes")))
            .collect());
    }
    positions.extract().map_err(|e| {
        PyTypeError::new_err(format!(
            "positions must be a sequence of ints (64-bit), one per key: {e}"
        ))
    })
}

fn ranked(rank: Option<u64>, first_position: i64, each: Option<&[i64]>) -> Option<RankedBatch<'_>> {
    rank.map(|rank| RankedBatch {
        rank,
        positions: each.map_or(Positions::From(first_position), Positions::Each),
    })
}

/// Grows `used` (one flag byte per chunk) to `need` bytes if shorter, with zeros: the flags
/// already set stay, none is added.
fn grow_used(used: &Bound<'_, PyByteArray>, need: usize) -> PyResult<()> {
    let had = used.len();
    if had >= need {
        return Ok(());
    }
    used.resize(need)?;
    // SAFETY: the GIL is held and no Python code runs while the bytes are written, so nothing
    // else can resize or read the array meanwhile; the range is within its new length.
    let flags = unsafe { used.as_bytes_mut() };
    flags[had..].fill(0); // CPython does not zero grown bytes
    Ok(())
}

/// Flags `chunks` in `used`, growing it as needed.
fn mark_used(used: &Bound<'_, PyByteArray>, chunks: &[u64]) -> PyResult<()> {
    let Some(&last) = chunks.iter().max() else {
        return Ok(());
    };
    grow_used(
        used,
        usize::try_from(last).map_or(usize::MAX, |c| c.saturating_add(1)),
    )?;
    // SAFETY: as in `grow_used`; every index is below the length.
    let flags = unsafe { used.as_bytes_mut() };
    for &c in chunks {
        flags[c as usize] = 1;
    }
    Ok(())
}
