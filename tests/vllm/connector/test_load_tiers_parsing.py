"""`parse_load_tiers` + `tier_allowed` decide every tier exactly as vLLM 0.33's own
`kv_load_tiers` parser (`_parse_tier_filter` and `TierFilter.allows`), for valid and invalid
values alike; and each value ours ignores warns once and is counted."""

from __future__ import annotations

import itertools
import logging

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import _parse_tier_filter
from vllm.v1.kv_offload.base import Locality, Medium

from kvoffload.scheduler.params import parse_load_tiers, tier_allowed

TIERS = list(itertools.product(("CPU", "STORAGE"), ("LOCAL", "REMOTE")))

# (raw kv_load_tiers, how many warnings ours gives (non-list value or invalid entry), the tiers
# allowed). "absent" is the key left out; None is the key present with None (vLLM then never
# parses it: every tier is allowed).


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
ALL = set(TIERS)
CASES = [
    (ABSENT, 0, ALL),
    (None, 0, ALL),
    ("cpu", 1, ALL),
    (3, 1, ALL),
    ({"medium": "cpu"}, 1, ALL),
    (("cpu",), 1, ALL),
    ("", 1, ALL),
    (False, 1, ALL),
    ([], 0, set()),
    ([{}], 0, ALL),
    ([{"medium": "cpu"}], 0, {("CPU", "LOCAL"), ("CPU", "REMOTE")}),
    ([{"medium": "CPU"}], 0, {("CPU", "LOCAL"), ("CPU", "REMOTE")}),
    ([{"medium": "Cpu", "locality": None}], 0, {("CPU", "LOCAL"), ("CPU", "REMOTE")}),
    ([{"medium": "storage"}], 0, {("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")}),
    ([{"locality": "remote"}], 0, {("CPU", "REMOTE"), ("STORAGE", "REMOTE")}),
    ([{"locality": "local"}], 0, {("CPU", "LOCAL"), ("STORAGE", "LOCAL")}),
    ([{"medium": "storage", "locality": "remote"}], 0, {("STORAGE", "REMOTE")}),
    ([{"medium": "\u017ftorage"}], 0, {("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")}),  # long s
    ([{"medium": "cpu", "locality": "LOCAL", "extra": 1}], 0, {("CPU", "LOCAL")}),
    (
        [{"medium": "storage", "locality": "remote"}, {"medium": "cpu", "locality": "local"}],
        0,
        {("STORAGE", "REMOTE"), ("CPU", "LOCAL")},
    ),
    ([{"medium": None, "locality": None}], 0, ALL),
    ([{"medium": "tape"}], 1, ALL),
    ([{"medium": 3}], 1, ALL),
    ([{"medium": ""}], 1, ALL),
    ([{"medium": b"cpu"}], 1, ALL),
    ([{"medium": ["cpu"]}], 1, ALL),
    ([3], 1, ALL),
    (["cpu"], 1, ALL),
    ([None], 1, ALL),
    ([[{"medium": "cpu"}]], 1, ALL),
    ([{"locality": "near"}], 1, ALL),
    ([{"locality": True}], 1, ALL),
    ([{"medium": "tape", "locality": "near"}], 1, ALL),  # one entry, one warning
    ([{"medium": "tape"}, {"medium": "cpu"}], 1, {("CPU", "LOCAL"), ("CPU", "REMOTE")}),
    ([{"medium": "cpu", "locality": "near"}], 1, ALL),  # a bad locality voids the entry
    (
        [{"medium": "cpu", "locality": "near"}, {"locality": "remote"}],
        1,
        {
            ("CPU", "REMOTE"),
            ("STORAGE", "REMOTE"),
        },
    ),
    ([3, "x", {"medium": "tape"}, {"locality": "near"}], 4, ALL),
    ([3, {"medium": "storage", "locality": "remote"}, None], 2, {("STORAGE", "REMOTE")}),
    ([{"medium": "cpu"}, {"medium": "cpu"}], 0, {("CPU", "LOCAL"), ("CPU", "REMOTE")}),
    ([{}, {"medium": "tape"}], 1, ALL),
]


def params_of(raw: object) -> dict:
    return {} if raw is ABSENT else {"kv_load_tiers": raw}


def vllm_allowed(raw: object) -> set[tuple[str, str]]:
    if raw is None or raw is ABSENT:
        return set(TIERS)  # vLLM only parses a value that is present and not None
    tier_filter = _parse_tier_filter(raw)
    return {(m, loc) for m, loc in TIERS if tier_filter.allows(Medium[m], Locality[loc])}


@pytest.mark.parametrize(("raw", "warnings", "allowed"), CASES, ids=repr)
def test_our_filter_decides_as_vllms(raw, warnings, allowed, caplog):
    ignored: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        matchers = parse_load_tiers("req-9", params_of(raw), ignored)
    ours = {(m, loc) for m, loc in TIERS if tier_allowed(matchers, m, loc)}
    assert ours == vllm_allowed(raw)
    assert ours == allowed

    ours_warned = [r for r in caplog.records if r.name.startswith("kvoffload")]
    assert len(ours_warned) == warnings
    assert all(r.levelno == logging.WARNING for r in ours_warned)
    assert all("req-9" in r.getMessage() for r in ours_warned)
    assert all("kv_load_tiers" in r.getMessage() for r in ours_warned)
    assert ignored == ({"kv_load_tiers": warnings} if warnings else {})


def test_every_tier_is_checked_against_vllm_one_by_one():
    # The same table, tier by tier, straight through `allows` (no set arithmetic in between).
    for raw, _, _ in CASES:
        if raw is None or raw is ABSENT:
            matchers = parse_load_tiers("r", params_of(raw), {})
            assert matchers is None
            assert all(tier_allowed(matchers, m, loc) for m, loc in TIERS)
            continue
        tier_filter = _parse_tier_filter(raw)
        matchers = parse_load_tiers("r", params_of(raw), {})
        for medium, locality in TIERS:
            assert tier_allowed(matchers, medium, locality) == tier_filter.allows(
                Medium[medium], Locality[locality]
            ), (raw, medium, locality)


def test_ignored_counts_add_up_across_requests(caplog):
    ignored = {"kv_load_tiers": 2, "max_load_tokens": 1}
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        parse_load_tiers("a", {"kv_load_tiers": "cpu"}, ignored)
        parse_load_tiers("b", {"kv_load_tiers": [{"medium": "tape"}, 7]}, ignored)
        parse_load_tiers("c", {"kv_load_tiers": [{"medium": "cpu"}]}, ignored)
    assert ignored == {"kv_load_tiers": 5, "max_load_tokens": 1}
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("kvoffload")]
    assert len(messages) == 3
    assert "request a" in messages[0] and "'cpu'" in messages[0] and "str" in messages[0]
    assert "request b" in messages[1] and "'tape'" in messages[1]
    assert "request b" in messages[2] and "7" in messages[2]


def test_an_empty_list_allows_no_tier_but_all_invalid_entries_allow_every_tier():
    assert parse_load_tiers("r", {"kv_load_tiers": []}, {}) == ()
    assert parse_load_tiers("r", {"kv_load_tiers": [{"medium": "tape"}]}, {}) is None
    assert _parse_tier_filter([]).matchers == ()
    assert not any(tier_allowed((), m, loc) for m, loc in TIERS)
