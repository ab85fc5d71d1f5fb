//! Chunk arithmetic of the scheduler (SPEC section 4), as pure functions.

use crate::error::{Error, Result};

/// Bytes of the KV-group index appended to a block hash to make a key (vLLM's `OffloadKey`).
pub const GROUP_SUFFIX_LEN: usize = 4;

/// The per-request numbers that bound a store.
#[derive(Debug, Clone, Copy)]
pub struct StoreBounds {
    /// Tokens whose KV exists after this step (the engine's `num_computed_tokens`).
    pub computed_tokens: u64,
    /// The request's tokens so far (prompt + output).
    pub num_tokens: u64,
    pub num_prompt_tokens: u64,
    pub max_offload_tokens: Option<u64>,
    pub offload_prompt_only: bool,
    pub tokens_per_chunk: u64,
    pub num_gpu_blocks: u64,
    pub blocks_per_chunk: u64,
    /// Chunks that have a key (their last block is hashed).
    pub num_keys: u64,
}

/// How many leading chunks of a request may be stored now: the tokens computed, clamped by the
/// request's length, `max_offload_tokens` and (if `offload_prompt_only`) the prompt, counted in
/// whole chunks, and never beyond the GPU blocks allocated or the chunks that have keys.
pub fn storable_chunks(b: &StoreBounds) -> Result<u64> {
    positive("tokens_per_chunk", b.tokens_per_chunk)?;
    positive("blocks_per_chunk", b.blocks_per_chunk)?;
    let mut n = b.computed_tokens.min(b.num_tokens);
    if let Some(cap) = b.max_offload_tokens {
        n = n.min(cap);
    }
    if b.offload_prompt_only {
        n = n.min(b.num_prompt_tokens);
    }
    Ok((n / b.tokens_per_chunk)
        .min(b.num_gpu_blocks / b.blocks_per_chunk)
        .min(b.num_keys))
}

/// The chunks a lookup must examine: keys `first_chunk..end_chunk`, and the token bound a hit
/// range may not pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadWindow {
    pub first_chunk: u64,
    pub end_chunk: u64,
    pub max_hit_tokens: u64,
}

/// The lookup window for a request with `num_local_tokens` already on the GPU, or `None` when
/// less than one chunk could be loaded, so no lookup is needed at all.
pub fn load_window(
    num_tokens: u64,
    num_local_tokens: u64,
    max_load_tokens: Option<u64>,
    num_keys: u64,
    tokens_per_chunk: u64,
) -> Result<Option<LoadWindow>> {
    positive("tokens_per_chunk", tokens_per_chunk)?;
    let capped = max_load_tokens.is_some();
    let max_hit = load_cap(num_tokens, num_local_tokens, max_load_tokens);
    // Within 0..=num_tokens, so a u64.
    let max_hit = clamp_to_keys(max_hit, num_keys, tokens_per_chunk, capped) as u64;
    if max_hit < num_local_tokens.saturating_add(tokens_per_chunk) {
        return Ok(None);
    }
    Ok(Some(LoadWindow {
        first_chunk: num_local_tokens / tokens_per_chunk,
        end_chunk: max_hit.div_ceil(tokens_per_chunk),
        max_hit_tokens: max_hit,
    }))
}

/// Tokens loadable beyond the local prefix when the first `hits` keys of `window` are ready;
/// 0 when that is less than one chunk.
pub fn loadable_tokens(
    window: &LoadWindow,
    hits: u64,
    num_local_tokens: u64,
    tokens_per_chunk: u64,
) -> u64 {
    // Saturating: the bound is clamped by `max_hit_tokens` anyway, and callers pass any u64.
    let end = window
        .max_hit_tokens
        .min(tokens_per_chunk.saturating_mul(window.first_chunk.saturating_add(hits)));
    match end.checked_sub(num_local_tokens) {
        Some(n) if n >= tokens_per_chunk => n,
        _ => 0,
    }
}

/// The furthest token a hit may reach: `num_tokens`, or fewer under `max_load_tokens` (tokens
/// past `num_local`). Signed and wide: a hybrid lookup steps back a token from it, maybe below 0.
pub(crate) fn load_cap(num_tokens: u64, num_local: u64, max_load_tokens: Option<u64>) -> i128 {
    let end = i128::from(num_tokens);
    match max_load_tokens {
        Some(cap) => end.min(i128::from(num_local) + i128::from(cap)),
        None => end,
    }
}

/// `max_hit` no further than the `num_keys` chunks that have keys and, under a cap (`capped`),
/// down to a whole chunk: a capped load never ends mid-chunk.
pub(crate) fn clamp_to_keys(max_hit: i128, num_keys: u64, tpc: u64, capped: bool) -> i128 {
    let max_hit = max_hit.min(i128::from(num_keys.saturating_mul(tpc)));
    if capped {
        floor_chunk(max_hit, tpc)
    } else {
        max_hit
    }
}

/// `x` down to a whole number of chunks of `tpc` tokens (below 0 too).
pub(crate) fn floor_chunk(x: i128, tpc: u64) -> i128 {
    let tpc = i128::from(tpc);
    x.div_euclid(tpc) * tpc
}

pub(crate) fn positive(name: &'static str, v: u64) -> Result<()> {
    if v == 0 {
        return Err(Error::InvalidArgument {
            name,
            value: "0".into(),
            allowed: "an integer >= 1",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TPC: u64 = 12;

    fn window(num_tokens: u64, local: u64, cap: Option<u64>, keys: u64) -> Option<LoadWindow> {
        load_window(num_tokens, local, cap, keys, TPC).unwrap()
    }

    #[test]
    fn loadable_tokens_saturates_instead_of_wrapping() {
        let w = LoadWindow {
            first_chunk: u64::MAX / 2,
            end_chunk: u64::MAX,
            max_hit_tokens: u64::MAX - 5,
        };
        // 12 * (2^63 + 3) wraps to 36 in u64: that would offer nothing (or panic in debug).
        assert_eq!(loadable_tokens(&w, 3, 100, TPC), u64::MAX - 105);
        assert_eq!(loadable_tokens(&w, u64::MAX, 0, TPC), u64::MAX - 5);
    }

    /// Loadable tokens when every key in the window is ready.
    fn all_hit(num_tokens: u64, local: u64, cap: Option<u64>, keys: u64) -> u64 {
        window(num_tokens, local, cap, keys).map_or(0, |w| {
            loadable_tokens(&w, w.end_chunk - w.first_chunk, local, TPC)
        })
    }

    #[test]
    fn load_window_matches_the_seed_scenarios() {
        // Second request of 40 tokens after a first one stored 3 chunks (36 tokens).
        assert_eq!(all_hit(40, 0, None, 3), 36);
        assert_eq!(window(40, 0, Some(0), 3), None);
        assert_eq!(window(40, 0, Some(11), 3), None);
        assert_eq!(all_hit(40, 0, Some(24), 3), 24);
        assert_eq!(all_hit(40, 0, Some(30), 3), 24);
        assert_eq!(all_hit(40, 12, Some(12), 3), 12);
        let w = window(40, 12, Some(12), 3).unwrap();
        assert_eq!((w.first_chunk, w.end_chunk), (1, 2));
        // Local prefix not chunk-aligned: still whole chunks 0..3.
        let w = window(40, 4, None, 3).unwrap();
        assert_eq!((w.first_chunk, w.end_chunk, w.max_hit_tokens), (0, 3, 36));
        assert_eq!(loadable_tokens(&w, 3, 4, TPC), 32);
    }

    #[test]
    fn partial_hits_and_short_hits() {
        let w = window(40, 0, None, 3).unwrap();
        assert_eq!(loadable_tokens(&w, 0, 0, TPC), 0);
        assert_eq!(loadable_tokens(&w, 2, 0, TPC), 24);
        // Local 20 tokens, hits up to 24: only 4 more, less than a chunk.
        let w = window(40, 20, None, 3).unwrap();
        assert_eq!(loadable_tokens(&w, 1, 20, TPC), 0);
        assert_eq!(loadable_tokens(&w, 2, 20, TPC), 16);
        // Without a cap, a window can end mid-chunk: the last chunk's key covers num_tokens.
        let w = window(30, 0, None, 3).unwrap();
        assert_eq!((w.end_chunk, w.max_hit_tokens), (3, 30));
    }

    fn bounds(
        computed: u64,
        num_tokens: u64,
        prompt: u64,
        cap: Option<u64>,
        prompt_only: bool,
    ) -> StoreBounds {
        StoreBounds {
            computed_tokens: computed,
            num_tokens,
            num_prompt_tokens: prompt,
            max_offload_tokens: cap,
            offload_prompt_only: prompt_only,
            tokens_per_chunk: TPC,
            num_gpu_blocks: 100,
            blocks_per_chunk: 3,
            num_keys: 100,
        }
    }

    #[test]
    fn storable_chunks_applies_every_clamp() {
        assert_eq!(storable_chunks(&bounds(72, 73, 24, None, true)).unwrap(), 2);
        assert_eq!(storable_chunks(&bounds(72, 73, 30, None, true)).unwrap(), 2);
        assert_eq!(
            storable_chunks(&bounds(72, 73, 24, None, false)).unwrap(),
            6
        );
        assert_eq!(
            storable_chunks(&bounds(36, 37, 36, Some(24), false)).unwrap(),
            2
        );
        assert_eq!(
            storable_chunks(&bounds(36, 37, 36, Some(25), false)).unwrap(),
            2
        );
        assert_eq!(
            storable_chunks(&bounds(36, 37, 36, Some(0), false)).unwrap(),
            0
        );
        assert_eq!(
            storable_chunks(&bounds(50, 40, 40, None, false)).unwrap(),
            3
        );
        let mut b = bounds(72, 73, 72, None, false);
        b.num_gpu_blocks = 8;
        assert_eq!(storable_chunks(&b).unwrap(), 2);
        b.num_keys = 1;
        assert_eq!(storable_chunks(&b).unwrap(), 1);
    }
}
