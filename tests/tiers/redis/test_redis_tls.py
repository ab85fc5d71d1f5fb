"""The shared tier over TLS (`rediss://`) through `RedisClient` and `RedisTierConfig`, against a
real `redis-server` with a TLS port and certificates made by `tests/tls/make_certs.sh`: a verified
connection moves every byte; every way a TLS set-up can be wrong stops start-up with a
`ConfigError` naming the URL (password masked), never a plaintext fallback."""

from __future__ import annotations

import numpy as np
import pytest
from test_redis_client import CHUNK, IDENTITY, client, finish, keys, pool

from kvoffload import ConfigError
from kvoffload.tiers import OK
from kvoffload.tiers.redis import RedisClient, RedisTierConfig
from redis_server import redis_server


def test_verified_round_trip_byte_for_byte(redis_tls):
    c = client(redis_tls.tls_url, tls_ca_file=redis_tls.cert("ca.crt"))
    assert c.startup_error is None
    src = pool(16, 1)
    ks = keys(16)
    assert finish(c, c.store(ks, src, [i * CHUNK for i in range(16)])) == bytes([OK]) * 16
    dst = np.zeros_like(src)
    assert finish(c, c.load(ks, dst, [i * CHUNK for i in range(16)])) == bytes([OK]) * 16
    assert np.array_equal(dst, src)
    # A replica on the plain port of the same server reads what went over TLS.
    plain = client(redis_tls.url)
    assert finish(plain, plain.lookup(ks)) == bytes([OK]) * 16
    c.close()
    plain.close()


def test_mutual_tls():
    with redis_server(tls=True, tls_auth_clients=True, password="hunter2") as server:
        with pytest.raises(ConfigError, match=r"client certificate \(tls_cert_file") as err:
            client(server.tls_url, tls_ca_file=server.cert("ca.crt"))
        assert "rediss://:***@127.0.0.1" in str(err.value) and "hunter2" not in str(err.value)
        c = client(
            server.tls_url,
            tls_ca_file=server.cert("ca.crt"),
            tls_cert_file=server.cert("client.crt"),
            tls_key_file=server.cert("client.key"),
        )
        ks = keys(3, salt=5)
        assert finish(c, c.store(ks, pool(3, 2), [0, CHUNK, 2 * CHUNK])) == bytes([OK]) * 3
        c.close()


@pytest.mark.parametrize(
    "options,match",
    [
        ({"tls_ca_file": "other-ca.crt"}, "not signed by a CA of tls_ca_file"),
        ({"tls_ca_file": "ca.crt", "tls_server_name": "redis.example.com"}, "set tls_server_name"),
    ],
)
def test_a_certificate_that_does_not_verify_stops_start_up(redis_tls, options, match):
    paths = {k: v if k == "tls_server_name" else redis_tls.cert(v) for k, v in options.items()}
    with pytest.raises(ConfigError, match=match) as err:
        client(redis_tls.tls_url, **paths)
    assert redis_tls.tls_url in str(err.value)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"tls_ca_file": "ca.crt", "tls_cert_file": "client.crt"}, "needs both"),
        ({"tls_ca_file": "missing.crt"}, "tls_ca_file=.*missing.crt.*cannot read it"),
        (
            {"tls_ca_file": "ca.crt", "tls_cert_file": "client.crt", "tls_key_file": "ca.key"},
            "tls_key_file=.*does not go with tls_cert_file",
        ),
    ],
)
def test_bad_tls_files_stop_start_up_naming_the_key(redis_tls, options, match):
    paths = {k: redis_tls.cert(v) for k, v in options.items()}
    with pytest.raises(ConfigError, match=match):
        client(redis_tls.tls_url, **paths)


def test_plain_against_tls_and_tls_against_plain_stop_start_up(redis_tls):
    plain_to_tls = f"redis://127.0.0.1:{redis_tls.tls_port}/0"
    with pytest.raises(ConfigError, match=r"it is a TLS port \(use rediss://") as err:
        client(plain_to_tls)
    assert plain_to_tls in str(err.value)
    tls_to_plain = f"rediss://127.0.0.1:{redis_tls.port}/0"
    with pytest.raises(ConfigError, match="it is a plain port") as err:
        client(tls_to_plain, tls_ca_file=redis_tls.cert("ca.crt"))
    assert tls_to_plain in str(err.value)


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"tls_ca_file": 3}, "tls_ca_file=3 .int. is invalid"),
        ({"tls_server_name": ""}, "tls_server_name='' .str. is invalid"),
        ({"tls_ca_file": "/ca.pem"}, "tls_ca_file set, but the url is not a TLS URL"),
    ],
)
def test_tls_keys_are_checked_before_any_connection(entry, match):
    # Nothing listens on port 1: each error comes before a connection is tried.
    with pytest.raises(ConfigError, match=match):
        config = RedisTierConfig.from_dict(
            {"url": "redis://127.0.0.1:1/0", "namespace": "n"} | entry
        )
        RedisClient(config, IDENTITY.digest(), CHUNK)
