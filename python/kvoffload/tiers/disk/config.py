"""`DiskTierConfig`: one `secondary_tiers` entry of type `DiskTier`, checked key by key."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.sizes import with_sizes
from kvoffload.tiers.checks import check_entry, namespace_of

_DIRECT_IO = ("auto", "on", "off")
DRAIN_TIMEOUT_S = 60.0
"""How long a shutdown waits for the disk I/O in flight (a hung mount fails it then)."""
_BLOCK = 4096


def file_bytes(chunk_bytes: int) -> int:
    """Bytes of one chunk's file: its header block, then the chunk padded to whole blocks (what
    `capacity_bytes` counts)."""
    return _BLOCK + -(-chunk_bytes // _BLOCK) * _BLOCK


def _checked(
    entry: Mapping[str, Any], key: str, default: Any, ok: Callable[[Any], bool], expected: str
) -> Any:
    """`entry[key]` (or `default`), or a `ConfigError` naming the key, the value and `expected`."""
    value = entry.get(key, default)
    if not ok(value):
        raise ConfigError(f"DiskTier {key}={value!r} is invalid: {expected}")
    return value


def _int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v <= high


def _seconds_in(low: float, high: float) -> Callable[[Any], bool]:
    # NaN fails the comparison, so it is refused too.
    return lambda v: type(v) in (int, float) and low <= v <= high


def _is_bool(value: Any) -> bool:
    return type(value) is bool


_FILE_MODES = {"0600": 0o600, "0640": 0o640, "0660": 0o660}


def _file_mode(value: object) -> int:
    """`file_mode` as JSON can write it: "0600", "0640" or "0660" (or those numbers)."""
    text = value if isinstance(value, str) else None
    if type(value) is int and value in _FILE_MODES.values():
        return value
    if text is not None and text.zfill(4) in _FILE_MODES:
        return _FILE_MODES[text.zfill(4)]
    raise ConfigError(
        f'DiskTier file_mode={value!r} is invalid; allowed: "0600" (the engine\'s user only), '
        '"0640" or "0660" (shared with its group, for engines running as different users of '
        "one group)"
    )


@dataclass(frozen=True)
class DiskTierConfig:
    """The disk tier's settings; the docs' Disk tier page documents each one."""

    path: str
    capacity_bytes: int
    namespace: str
    direct_io: str = "auto"
    io_threads: int = 8
    rescan_interval_s: float = 10.0
    max_store_bytes_in_flight: int = 1 << 30
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    enable_kv_events: bool = False
    read_only: bool = False
    probes_per_step: int = 64
    probe_miss_ttl_s: float = 1.0
    file_mode: int = 0o600

    @classmethod
    def from_dict(cls, entry: object) -> DiskTierConfig:
        """Reads one `secondary_tiers` entry. Unknown keys and bad values raise `ConfigError`
        naming the key."""
        entry = check_entry(entry, "DiskTier", cls.__dataclass_fields__)
        path = entry.get("path")
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(
                f"DiskTier path={path!r} is invalid: it is required, the tier's directory (e.g. "
                "'/mnt/nvme/kvoffload'; several engines may share one)"
            )
        entry = with_sizes(entry, ("capacity_bytes", "max_store_bytes_in_flight"), "DiskTier ")
        capacity = entry.get("capacity_bytes")
        if type(capacity) is not int or capacity < 1:
            raise ConfigError(
                f"DiskTier capacity_bytes={capacity!r} is invalid: it is required, the bytes of "
                "files the tier may keep (an int >= 1; the least recently used go past it)"
            )
        namespace = namespace_of(entry, "DiskTier")
        direct = entry.get("direct_io", "auto")
        if direct not in _DIRECT_IO:
            raise ConfigError(
                f"DiskTier direct_io={direct!r} is invalid; allowed: "
                f"{', '.join(map(repr, _DIRECT_IO))}"
            )
        threads = _checked(entry, "io_threads", 8, _int_in(1, 256), "expected an int in [1, 256]")
        rescan = _checked(
            entry,
            "rescan_interval_s",
            10.0,
            _seconds_in(0, 86400),
            "expected seconds in [0, 86400] (0: only at start-up)",
        )
        max_store = _checked(
            entry,
            "max_store_bytes_in_flight",
            1 << 30,
            _int_in(1, 1 << 40),
            "expected an int in [1, 2**40] (stores past it are dropped, never queued)",
        )
        failures = _checked(
            entry,
            "breaker_failures",
            3,
            _int_in(1, 1000),
            "expected an int in [1, 1000] (I/O failures in a row that mark the disk down)",
        )
        cooldown = _checked(
            entry,
            "breaker_cooldown_s",
            10.0,
            _seconds_in(0.01, 3600),
            "expected seconds in [0.01, 3600] (how long a failing disk is left alone before a "
            "probe)",
        )
        events = _checked(entry, "enable_kv_events", False, _is_bool, "true or false")
        read_only = _checked(
            entry,
            "read_only",
            False,
            _is_bool,
            "true (serve the directory, never write it) or false",
        )
        probes = _checked(
            entry,
            "probes_per_step",
            64,
            _int_in(0, 100_000),
            "expected an int in [0, 100000] (lookups per step that may look for other engines' "
            "new files; 0: none)",
        )
        miss_ttl = _checked(
            entry,
            "probe_miss_ttl_s",
            1.0,
            _seconds_in(0, 3600),
            "expected seconds in [0, 3600] (how long a file a probe did not find is a miss "
            "without looking again)",
        )
        mode = _file_mode(entry.get("file_mode", "0600"))
        return cls(
            path,
            capacity,
            namespace,
            direct,
            threads,
            float(rescan),
            max_store,
            failures,
            float(cooldown),
            events,
            read_only,
            probes,
            float(miss_ttl),
            mode,
        )

    @property
    def where(self) -> str:
        return self.path

    @property
    def drain_timeout_s(self) -> float:
        return DRAIN_TIMEOUT_S

    def shard_capacity_bytes(self, num_shards: int) -> int:
        """`capacity_bytes`, split evenly over the shards of every chunk."""
        return self.capacity_bytes // num_shards
