"""`DiskClient` over the Rust disk tier, on this machine's filesystem: jobs with numpy buffers,
the index's lookups and capacity, a restart, and bad settings."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from kvoffload import ConfigError
from kvoffload.tiers import CORRUPT, DROPPED, EXISTS, MISSING, OK
from kvoffload.tiers.disk import DiskClient, DiskTierConfig
from mounts import read_only

CHUNK = 16 * 1024
DIGEST = hashlib.blake2b(b"disk-client-test", digest_size=16).digest()


def client(path: Path, capacity_chunks: int = 100, **options: object) -> DiskClient:
    entry = {
        "path": str(path),
        "capacity_bytes": capacity_chunks * (4096 + CHUNK),
        "namespace": "m@1",
        **options,
    }
    c = DiskClient(DiskTierConfig.from_dict(entry), DIGEST, CHUNK)
    deadline = time.monotonic() + 10
    while not c.scanned:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return c


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt]) * 32 + i.to_bytes(4, "big") for i in range(n)]


def done(c: DiskClient, job: int) -> bytes:
    got = dict(c.drain(30))
    return got[job]


def test_chunks_round_trip_in_place_and_lookups_answer_from_the_index(tmp_path):
    c = client(tmp_path)
    ks = keys(8)
    src = np.random.default_rng(1).integers(0, 256, 8 * CHUNK, dtype=np.uint8)
    offsets = [i * CHUNK for i in range(8)]
    assert done(c, c.store(ks, src, offsets)) == bytes([OK]) * 8
    assert done(c, c.store(ks[:1], src, [0])) == bytes([EXISTS])
    dest = np.zeros_like(src)
    assert done(c, c.load(ks, dest, offsets)) == bytes([OK]) * 8
    assert np.array_equal(dest, src)
    assert c.lookup_prefix([*ks[:3], keys(1, salt=9)[0], ks[4]]) == 3
    assert done(c, c.load(keys(1, salt=9), dest, [0])) == bytes([MISSING])
    s = c.stats()
    assert (s["stored_chunks"], s["loaded_chunks"], s["chunks"]) == (8, 8, 8)


def test_a_damaged_file_is_never_served(tmp_path):
    c = client(tmp_path, direct_io="off")
    (k,) = keys(1)
    src = np.full(CHUNK, 7, dtype=np.uint8)
    assert done(c, c.store([k], src, [0])) == bytes([OK])
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file() and p.name == k.hex()]
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 1
    path.write_bytes(bytes(raw))
    dest = np.zeros(CHUNK, dtype=np.uint8)
    assert done(c, c.load([k], dest, [0])) == bytes([CORRUPT])
    assert not path.exists() and c.lookup_prefix([k]) == 0
    assert c.stats()["corrupt"] == 1


def test_a_restarted_client_serves_what_the_last_one_stored(tmp_path):
    first = client(tmp_path)
    ks = keys(4)
    src = np.arange(4 * CHUNK, dtype=np.uint8)
    assert done(first, first.store(ks, src, [i * CHUNK for i in range(4)])) == bytes([OK]) * 4
    first.close()
    second = client(tmp_path)
    assert second.lookup_prefix(ks) == 4
    dest = np.zeros_like(src)
    assert done(second, second.load(ks, dest, [i * CHUNK for i in range(4)])) == bytes([OK]) * 4
    assert np.array_equal(dest, src)


def test_capacity_bytes_is_held(tmp_path):
    c = client(tmp_path, capacity_chunks=3)
    src = np.zeros(CHUNK, dtype=np.uint8)
    for k in keys(5):
        assert done(c, c.store([k], src, [0])) == bytes([OK])
    s = c.stats()
    assert (s["chunks"], s["evicted"]) == (3, 2)
    assert sum(1 for p in tmp_path.rglob("*") if p.is_file()) == 3


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"path": ""}, "path=''"),
        ({"capacity_bytes": 0}, "capacity_bytes=0"),
        ({"capacity_bytes": 4096}, "capacity_bytes=4096 holds no chunk"),
        ({"namespace": " "}, "namespace=' '"),
        ({"direct_io": "yes"}, "direct_io='yes'"),
        ({"io_threads": 0}, "io_threads=0"),
        ({"rescan_interval_s": -1}, "rescan_interval_s=-1"),
        ({"max_store_bytes_in_flight": 0}, "max_store_bytes_in_flight=0"),
        ({"capcity_bytes": 1}, "unknown DiskTier key"),
        ({"read_only": "yes"}, "read_only='yes'"),
        ({"probes_per_step": -1}, "probes_per_step=-1"),
        ({"probe_miss_ttl_s": float("nan")}, "probe_miss_ttl_s=nan"),
        ({"file_mode": "0644"}, "file_mode='0644'"),
        ({"file_mode": 0o777}, "file_mode=511"),
    ],
)
def test_bad_settings_stop_start_up_naming_the_key(tmp_path, change, match):
    entry = {"path": str(tmp_path), "capacity_bytes": 1 << 30, "namespace": "m@1", **change}
    with pytest.raises(ConfigError, match=match):
        DiskClient(DiskTierConfig.from_dict(entry), DIGEST, CHUNK)


def test_a_path_that_cannot_be_a_directory_stops_start_up(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    entry = {"path": str(tmp_path / "file"), "capacity_bytes": 1 << 30, "namespace": "m@1"}
    with pytest.raises(ConfigError, match="cannot create the tier's directory"):
        DiskClient(DiskTierConfig.from_dict(entry), DIGEST, CHUNK)


def test_stores_past_max_store_bytes_in_flight_are_dropped(tmp_path):
    c = client(tmp_path, max_store_bytes_in_flight=2 * CHUNK)
    src = np.zeros(3 * CHUNK, dtype=np.uint8)
    assert done(c, c.store(keys(3), src, [0, CHUNK, 2 * CHUNK])) == bytes([DROPPED]) * 3
    assert c.stats()["stores_dropped"] == 3
    assert done(c, c.store(keys(2), src, [0, CHUNK])) == bytes([OK]) * 2


def answered(c: DiskClient) -> None:
    """Ends the step (its probes go out) and waits until they are answered."""
    c.flush()
    deadline = time.monotonic() + 10
    while c.probes_in_flight():
        assert time.monotonic() < deadline, "a probe was never answered"
        time.sleep(0.001)


def test_a_lookup_past_the_index_asks_again_while_the_files_are_looked_for(tmp_path):
    writer, reader = client(tmp_path), client(tmp_path)  # the default rescan: 10 s
    ks = keys(6)
    src = np.random.default_rng(2).integers(0, 256, 4 * CHUNK, dtype=np.uint8)
    assert done(writer, writer.store(ks[:4], src, [i * CHUNK for i in range(4)])) == bytes([OK]) * 4
    assert reader.lookup(ks, "r") == (0, True)
    answered(reader)
    assert reader.lookup(ks, "r") == (4, False)
    dest = np.zeros_like(src)
    assert done(reader, reader.load(ks[:4], dest, [i * CHUNK for i in range(4)])) == bytes([OK]) * 4
    assert np.array_equal(dest, src)
    s = reader.stats()
    assert (s["probed"], s["probe_hits"]) == (5, 4)
    # 200 prompts nobody wrote, in one step: 64 are looked for (probes_per_step), the others
    # answered by the index alone; each costs one file's lookup.
    waiting = sum(reader.lookup(keys(8, salt=10 + i), f"p{i}")[1] for i in range(200))
    assert waiting == 64
    answered(reader)
    assert reader.stats()["probed"] == 5 + 64


def test_a_read_only_directory_is_said_once_and_serves(tmp_path, caplog):
    src = tmp_path / "src"
    writer = client(src)
    data = np.full(CHUNK, 3, dtype=np.uint8)
    assert done(writer, writer.store(keys(1), data, [0])) == bytes([OK])
    with read_only(src, tmp_path / "ro") as ro:
        c = client(ro)
        for i in range(5):
            done(c, c.store(keys(1, salt=20 + i), data, [0]))
        assert c.writes == "read-only"
        said = [r for r in caplog.records if "refuses writes" in r.getMessage()]
        assert len(said) == 1 and "Read-only file system" in said[0].getMessage()
        dest = np.zeros_like(data)
        assert done(c, c.load(keys(1), dest, [0])) == bytes([OK])
        assert np.array_equal(dest, data)


@pytest.mark.parametrize(("file_mode", "modes"), [(None, (0o600, 0o700)), ("0640", (0o640, 0o750))])
def test_files_and_directories_are_private_under_a_permissive_umask(tmp_path, file_mode, modes):
    options = {} if file_mode is None else {"file_mode": file_mode}
    old = os.umask(0)
    try:
        c = client(tmp_path / "cache", **options)
        src = np.zeros(2 * CHUNK, dtype=np.uint8)
        assert done(c, c.store(keys(2), src, [0, CHUNK])) == bytes([OK]) * 2
    finally:
        os.umask(old)
    made = [tmp_path / "cache", *(tmp_path / "cache").rglob("*")]
    assert len(made) == 1 + 1 + 2 + 2 or len(made) == 1 + 1 + 1 + 2  # dir, namespace, fans, files
    for p in made:
        assert stat.S_IMODE(p.lstat().st_mode) == modes[p.is_dir()], p


def test_a_world_writable_cache_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ConfigError, match=r"writable by every user \(mode 1777\)"):
        client(shared)
