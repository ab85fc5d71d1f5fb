"""`RedisTierConfig`: one `secondary_tiers` entry of type `RedisTier`, checked key by key."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvoffload._rust import mask_remote_url
from kvoffload.errors import ConfigError
from kvoffload.sizes import with_sizes
from kvoffload.tiers.checks import check_entry, namespace_of

logger = logging.getLogger(__name__)

_WARNED_URLS: set[str] = set()
"""URLs whose password this process has warned about (once each)."""


def _number(entry: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    v = entry.get(key, default)
    if type(v) not in (int, float) or not math.isfinite(v) or not low <= v <= high:
        raise ConfigError(
            f"secondary tier {key}={v!r} ({type(v).__name__}) is invalid: "
            f"expected a number in [{low:g}, {high:g}]"
        )
    return float(v)


def _integer(entry: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    v = entry.get(key, default)
    if type(v) is not int or not low <= v <= high:
        raise ConfigError(
            f"secondary tier {key}={v!r} ({type(v).__name__}) is invalid: "
            f"expected an int in [{low}, {high}]"
        )
    return v


def _optional_text(entry: Mapping[str, Any], key: str, what: str) -> str | None:
    v = entry.get(key)
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise ConfigError(
            f"secondary tier {key}={v!r} ({type(v).__name__}) is invalid: expected {what}"
        )
    return v


def _cluster(entry: Mapping[str, Any]) -> bool | None:
    v = entry.get("cluster", "auto")
    if v == "auto" and isinstance(v, str):
        return None
    if type(v) is not bool:
        raise ConfigError(
            f'secondary tier cluster={v!r} ({type(v).__name__}) is invalid: expected "auto" '
            "(the first seed node that answers tells), true or false"
        )
    return v


def _flag(entry: Mapping[str, Any], key: str, default: bool) -> bool:
    v = entry.get(key, default)
    if type(v) is not bool:
        raise ConfigError(
            f"secondary tier {key}={v!r} ({type(v).__name__}) is invalid: expected true or false"
        )
    return v


@dataclass(frozen=True, repr=False)
class RedisTierConfig:
    """A Redis tier's settings; the docs' Shared tier page documents each one. Its `repr` never
    shows a password (the url's is masked; a file or a variable is named, never read here)."""

    url: str
    namespace: str
    connect_timeout_s: float = 1.0
    job_timeout_s: float = 2.0
    min_bandwidth_mb_s: float = 100.0
    connections: int = 2
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    ttl_s: float | None = None
    max_store_bytes_in_flight: int = 1 << 30
    touch_on_hit: bool = True
    enable_kv_events: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_server_name: str | None = None
    cluster: bool | None = None
    """True / False, or None ("auto"): the first seed node that answers tells."""
    password_file: str | None = None
    """A file holding the password (as Kubernetes mounts a secret), read by the data path at
    start-up and again when the server refuses it (a rotated secret)."""
    password_env: str | None = None
    """The name of an environment variable holding the password (read as `password_file`)."""

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["url"] = self.masked_url
        return f"RedisTierConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_dict(cls, entry: object) -> RedisTierConfig:
        """Reads one `secondary_tiers` entry. Unknown keys and bad values raise `ConfigError`
        naming the key."""
        entry = check_entry(entry, "RedisTier", cls.__dataclass_fields__)
        url = entry.get("url")
        # Its grammar is checked where it is parsed, in the Rust data path (RedisClient).
        if not isinstance(url, str) or not url:
            raise ConfigError(
                f"secondary tier url={_masked(url)!r} is invalid: it is required, e.g. "
                "'redis://[user:password@]host:port[/db]', 'rediss://...' (TLS), "
                "'redis://host1:port1,host2:port2' (a cluster's seed nodes) or "
                "'unix:///path/to.sock[?db=N]'"
            )
        namespace = namespace_of(entry, "RedisTier")
        ttl = entry.get("ttl_s")
        password_file = _optional_text(
            entry, "password_file", "the path of a file holding the password"
        )
        password_env = _optional_text(
            entry, "password_env", "the name of an environment variable holding the password"
        )
        if password_file is not None and password_env is not None:
            raise ConfigError(
                f"secondary tier password_file={password_file!r} and "
                f"password_env={password_env!r} are both set; allowed: one of them"
            )
        in_url = _masked(url) != url
        if in_url and (password_file or password_env):
            raise ConfigError(
                f"secondary tier url={_masked(url)!r} holds a password, and password_file or "
                "password_env is set too; allowed: the password in one place (password_file "
                "or password_env)"
            )
        if in_url and url not in _WARNED_URLS:
            _WARNED_URLS.add(url)
            logger.warning(
                "secondary tier url=%r holds a password: vLLM logs its configuration "
                "(kv_transfer_config, with this url) at start-up, so the password is in vLLM's "
                "log. Put it in a file (password_file, as a mounted Kubernetes secret) or an "
                "environment variable (password_env) instead",
                _masked(url),
            )
        return cls(
            url=url,
            namespace=namespace,
            connect_timeout_s=_number(entry, "connect_timeout_s", 1.0, 0.01, 60.0),
            job_timeout_s=_number(entry, "job_timeout_s", 2.0, 0.01, 600.0),
            min_bandwidth_mb_s=_number(entry, "min_bandwidth_mb_s", 100.0, 1.0, 1e6),
            connections=_integer(entry, "connections", 2, 1, 64),
            breaker_failures=_integer(entry, "breaker_failures", 3, 1, 1000),
            breaker_cooldown_s=_number(entry, "breaker_cooldown_s", 2.0, 0.01, 600.0),
            ttl_s=None if ttl is None else _number(entry, "ttl_s", 0.0, 0.001, 10.0 * 365 * 86400),
            max_store_bytes_in_flight=_integer(
                with_sizes(entry, ("max_store_bytes_in_flight",), "RedisTier "),
                "max_store_bytes_in_flight",
                1 << 30,
                1,
                1 << 40,
            ),
            touch_on_hit=_flag(entry, "touch_on_hit", True),
            enable_kv_events=_flag(entry, "enable_kv_events", False),
            # Whether the files are there and hold what they must is checked where they are
            # read, in the data path, before any connection.
            tls_ca_file=_optional_text(entry, "tls_ca_file", "the path of a PEM file"),
            tls_cert_file=_optional_text(entry, "tls_cert_file", "the path of a PEM file"),
            tls_key_file=_optional_text(entry, "tls_key_file", "the path of a PEM file"),
            tls_server_name=_optional_text(
                entry, "tls_server_name", "the DNS name or IP address of the certificate"
            ),
            cluster=_cluster(entry),
            password_file=password_file,
            password_env=password_env,
        )

    def client_options(self) -> dict[str, Any]:
        """The keyword arguments of `kvoffload._rust.RemoteTier`, the Redis data path."""
        return {
            "connect_timeout_s": self.connect_timeout_s,
            "job_timeout_s": self.job_timeout_s,
            "min_bandwidth_mb_s": self.min_bandwidth_mb_s,
            "connections": self.connections,
            "breaker_failures": self.breaker_failures,
            "breaker_cooldown_s": self.breaker_cooldown_s,
            "ttl_s": self.ttl_s,
            "max_store_bytes_in_flight": self.max_store_bytes_in_flight,
            "touch_on_hit": self.touch_on_hit,
            "tls_ca_file": self.tls_ca_file,
            "tls_cert_file": self.tls_cert_file,
            "tls_key_file": self.tls_key_file,
            "tls_server_name": self.tls_server_name,
            "cluster": self.cluster,
            "password_file": self.password_file,
            "password_env": self.password_env,
        }

    @property
    def masked_url(self) -> str:
        return mask_remote_url(self.url)

    @property
    def where(self) -> str:
        return self.masked_url

    @property
    def read_only(self) -> bool:
        return False

    @property
    def drain_timeout_s(self) -> float:
        # Every job ends by its deadline.
        return self.job_timeout_s + 1.0


def _masked(url: object) -> object:
    """The URL with its password replaced (the data path's own rule), for messages and logs."""
    return mask_remote_url(url) if isinstance(url, str) else url
