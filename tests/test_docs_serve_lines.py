"""Every `vllm serve ... --kv-transfer-config '...'` line of the README and the docs site is valid
JSON whose kvoffload settings our parsers take, so a pasted serve line never stops at start-up
on a typo in the docs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvoffload.scheduler import OffloadConfig
from kvoffload.tiers.disk import DiskTierConfig
from kvoffload.tiers.redis import RedisTierConfig

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINES = [
    (page.relative_to(ROOT).as_posix(), text[: m.start()].count("\n") + 1, m.group(1))
    for page in PAGES
    for text in [page.read_text()]
    for m in re.finditer(r"--kv-transfer-config '(\{.*?\})'", text, re.S)
]
# Read by the seams themselves, not by OffloadConfig.
_SEAM_KEYS = {
    "secondary_tiers",
    "spec_name",
    "spec_module_path",
    "pin_in_background",
    "self_describing_kv_events",
}


def tier(entry: dict) -> DiskTierConfig | RedisTierConfig:
    # A TLS CA file named in the docs is not on this machine: the rest is checked.
    entry = {k: v for k, v in entry.items() if k != "tls_ca_file"}
    return (DiskTierConfig if entry["type"] == "DiskTier" else RedisTierConfig).from_dict(entry)


@pytest.mark.parametrize(
    ("page", "line", "raw"), LINES, ids=[f"{page}:{line}" for page, line, _ in LINES]
)
def test_serve_line_parses(page, line, raw):
    config = json.loads(raw)
    extra = config.get("kv_connector_extra_config", {})
    ours = {k: v for k, v in extra.items() if k not in _SEAM_KEYS}
    if config["kv_connector"] == "KVOffloadConnector" or extra.get("spec_name") == "KVOffloadSpec":
        OffloadConfig.from_dict({**ours, "tokens_per_block": 16})
    tiers = extra.get("secondary_tiers", [])
    if config["kv_connector"] == "KVOffloadConnector" and tiers:
        vllm_tiers = pytest.importorskip("kvoffload.tiers.entries")
        assert len(vllm_tiers.parse_entries(tiers)) == len(tiers)
    for entry in tiers:
        if entry["type"] in ("DiskTier", "RedisTier"):
            tier(entry)


def test_the_readme_has_a_chain():
    readme = [json.loads(raw) for page, _, raw in LINES if page == "README.md"]
    kinds = [
        [t["type"] for t in c["kv_connector_extra_config"].get("secondary_tiers", [])]
        for c in readme
    ]
    assert ["DiskTier", "RedisTier"] in kinds
