"""A real `redis-server` (Debian's package) for the tests: started on a free loopback port with
persistence off, waited for with PING, stopped by pid; optionally with a TLS port beside the
plain one, its certificates made by `tests/tls/make_certs.sh` (openssl). Without the binary the
tests that need it skip, except under CI=true, where a missing server is an error."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
MAKE_CERTS = Path(__file__).parent / "tls" / "make_certs.sh"


def require_redis() -> str:
    if REDIS_SERVER is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise RuntimeError("redis-server is missing: .ci/run installs Debian's redis-server")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return REDIS_SERVER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@functools.cache
def certificates() -> Path:
    """`make_certs.sh`'s certificates, made once per test run (openssl takes a while)."""
    certs = Path(tempfile.mkdtemp(prefix="kvo-certs-"))
    atexit.register(shutil.rmtree, certs, ignore_errors=True)
    subprocess.run(["bash", str(MAKE_CERTS), str(certs)], check=True)
    return certs


class RedisServer:
    """One server process. `args` are extra `redis-server` options (e.g. maxmemory). With
    `tls`, it also listens with TLS on `tls_port` (`tls_auth_clients`: whether it requires a
    client certificate); the certificates are in `certs` (one set per test run)."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        password: str | None = None,
        tls: bool = False,
        tls_auth_clients: bool = False,
    ) -> None:
        self.binary = require_redis()
        self.port = port or free_port()
        self.password = password
        self.args = list(args)
        self.dir = tempfile.mkdtemp(prefix="kvo-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls_port = free_port() if tls else None
        self.certs = certificates() if tls else Path(self.dir) / "certs"
        if tls:
            self.args += [
                *("--tls-port", str(self.tls_port)),
                *("--tls-cert-file", str(self.certs / "server.crt")),
                *("--tls-key-file", str(self.certs / "server.key")),
                *("--tls-ca-cert-file", str(self.certs / "ca.crt")),
                *("--tls-auth-clients", "yes" if tls_auth_clients else "no"),
            ]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        assert self.tls_port is not None, "started without tls=True"
        auth = f":{self.password}@" if self.password else ""
        return f"rediss://{auth}127.0.0.1:{self.tls_port}/0"

    def cert(self, name: str) -> str:
        """The path of one of `make_certs.sh`'s files (ca.crt, other-ca.crt, client.key, ...)."""
        return str(self.certs / name)

    def start(self) -> RedisServer:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--protected-mode",
            "no",
            *self.args,
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.command("PING") in (b"PONG", b"NOAUTH Authentication required."):
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {cmd}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def empty(self) -> RedisServer:
        """The server as a test that wants an empty one expects it: running, not frozen, no
        keys, its INFO counters zero (a test before may have stopped or frozen it)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        else:
            self.thaw()
        self.command("FLUSHALL")
        self.command("CONFIG", "RESETSTAT")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen server cannot die otherwise
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def command(self, *args: str | bytes | int) -> object:
        """One command over a fresh connection (for tests: planting values, reading INFO)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            if self.password:
                s.sendall(encode("AUTH", self.password))
                read_reply(s.makefile("rb"))
            s.sendall(encode(*args))
            return read_reply(s.makefile("rb"))

    def keys(self) -> list[bytes]:
        reply = self.command("KEYS", "*")
        assert isinstance(reply, list)
        return sorted(reply)

    def used_memory(self) -> int:
        info = self.command("INFO", "memory")
        assert isinstance(info, bytes)
        for line in info.decode().splitlines():
            if line.startswith("used_memory:"):
                return int(line.split(":")[1])
        raise AssertionError("INFO memory has no used_memory")


def encode(*args: str | bytes | int) -> bytes:
    parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def read_reply(f: object) -> object:
    line = f.readline()  # type: ignore[attr-defined]
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        return rest  # errors come back as bytes; tests compare them
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)  # type: ignore[attr-defined]
        return data[:-2]
    if kind == b"*":
        return [read_reply(f) for _ in range(int(rest))]
    raise AssertionError(f"unexpected reply {line!r}")


class RedisCluster:
    """A local Redis Cluster: 3 primaries and 3 replicas (`RedisServer`s with
    `--cluster-enabled yes` and a 1 s node timeout), formed with `redis-cli --cluster create`."""

    def __init__(self) -> None:
        self.nodes = [
            RedisServer(
                *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                *("--cluster-node-timeout", "1000", "--cluster-port", str(free_port())),
            )
            for _ in range(6)
        ]

    @property
    def url(self) -> str:
        """One seed node is enough: the tier asks it for the rest."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        cli = shutil.which("redis-cli") or "redis-cli"
        subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(self._ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster never reached cluster_state:ok")
            time.sleep(0.1)
        return self

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        info = node.command("CLUSTER", "INFO")
        assert isinstance(info, bytes)
        return b"cluster_state:ok" in info and b"cluster_slots_ok:16384" in info

    def primaries(self) -> list[RedisServer]:
        return [n for n in self.nodes if bytes(n.command("ROLE")[0]) == b"master"]  # type: ignore[index]

    def keys(self) -> list[bytes]:
        return sorted(k for n in self.primaries() for k in n.keys())

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
            shutil.rmtree(n.dir, ignore_errors=True)


@contextmanager
def redis_cluster() -> Iterator[RedisCluster]:
    cluster = RedisCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@contextmanager
def redis_server(
    *args: str, password: str | None = None, tls: bool = False, tls_auth_clients: bool = False
) -> Iterator[RedisServer]:
    server = RedisServer(*args, password=password, tls=tls, tls_auth_clients=tls_auth_clients)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
