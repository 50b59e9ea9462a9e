"""API keys in the fleet's state: two coordinators over a real etcd accept a key added through
either one (PutApiKey, by its SHA-256 digest: no raw key reaches etcd), refuse it everywhere once
deleted, keep roles (a client key cannot make the operator's calls), and guard their HTTP APIs
with the same keys. With the state in memory, the first key added turns access control on."""
from __future__ import annotations

import secrets
import urllib.error
import urllib.request

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from flashfleet import Client
from flashfleet.auth import key_digest
from flashfleet.errors import InvalidArgument, ModelNotFound, PermissionDenied, Unauthenticated
from harness import LoopThread, wait_until

ADMIN = "sk-admin-" + secrets.token_hex(12)


def _accepted(address: str, key: str | None) -> bool:
    """Whether the coordinator lets a call with `key` through (False: UNAUTHENTICATED)."""
    try:
        with Client(address, api_key=key) as c:
            c.cluster_status(timeout_s=5)
        return True
    except Unauthenticated:
        return False


def _http_status(url: str, key: str | None) -> int:
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_key_added_through_one_coordinator_is_accepted_by_the_other(etcd, monkeypatch):
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    loop = LoopThread()
    common = {"port": 0, "state": "etcd", "etcd_endpoints": (etcd.endpoint,)}
    # a has a keys file (one admin key); b has none of its own: it takes the fleet's keys from etcd
    a = loop.run(start_coordinator(CoordinatorConfig(api_keys=(ADMIN,), admin_keys=(ADMIN,), **common)))
    b = loop.run(start_coordinator(CoordinatorConfig(http_port=0, **common)))
    try:
        assert wait_until(lambda: not _accepted(b.address, None), 10)  # a's seed reached b
        assert _accepted(b.address, ADMIN) and not _accepted(b.address, "sk-wrong")
        new = "sk-" + secrets.token_hex(16)
        assert not _accepted(a.address, new) and not _accepted(b.address, new)
        with Client(a.address, api_key=ADMIN) as admin:
            admin.put_api_key(new)
            with pytest.raises(InvalidArgument, match="unknown API key role"):
                admin.put_api_key("sk-other", role="root")
        assert _accepted(a.address, new)  # at once on the coordinator that wrote it
        assert wait_until(lambda: _accepted(b.address, new), 10)
        assert _http_status(b.http_url, new) == 200 and _http_status(b.http_url, None) == 401
        with Client(b.address, api_key=new) as client:  # a client key: not the operator's calls
            with pytest.raises(PermissionDenied, match="PutApiKey needs an API key with the admin role"):
                client.put_api_key("sk-" + secrets.token_hex(16), role="admin")
            with pytest.raises(PermissionDenied, match="DrainWorker needs an API key with the admin role"):
                list(client.drain_worker("w1", timeout_s=5))
        # etcd holds digests and roles, never a key
        kvs, _ = loop.run(b.state.client.get_prefix(b"/flashfleet/apikeys/"))
        stored = {kv.key.rsplit(b"/", 1)[1].decode(): kv.value.decode() for kv in kvs}
        assert stored == {key_digest(ADMIN): "admin", key_digest(new): "client"}
        everything, _ = loop.run(b.state.client.get_prefix(b"/"))
        assert not any(k.encode() in kv.key + kv.value for kv in everything for k in (ADMIN, new))
        # deleted through b: refused by both
        with Client(b.address, api_key=ADMIN) as admin:
            admin.delete_api_key(new)
            with pytest.raises(ModelNotFound, match="no API key has the digest"):
                admin.delete_api_key(new)
        assert wait_until(lambda: not _accepted(a.address, new), 10) and not _accepted(b.address, new)
        assert _http_status(b.http_url, new) == 401
        # a coordinator started later reads the keys from etcd
        c = loop.run(start_coordinator(CoordinatorConfig(**common)))
        try:
            assert not _accepted(c.address, None) and _accepted(c.address, ADMIN)
        finally:
            loop.run(c.stop(grace_s=0.5))
    finally:
        loop.run(a.stop(grace_s=0.5))
        loop.run(b.stop(grace_s=0.5))
        loop.close()


def test_without_keys_every_call_is_open_until_the_first_key_is_added(monkeypatch):
    monkeypatch.delenv("FLASHFLEET_API_KEY", raising=False)
    loop = LoopThread()
    coordinator = loop.run(start_coordinator(CoordinatorConfig(port=0, http_port=0)))
    try:
        assert _accepted(coordinator.address, None) and _http_status(coordinator.http_url, None) == 200
        with Client(coordinator.address) as client:
            client.put_api_key(ADMIN, role="admin")
        assert not _accepted(coordinator.address, None) and _accepted(coordinator.address, ADMIN)
        assert _http_status(coordinator.http_url, None) == 401 and _http_status(coordinator.http_url, ADMIN) == 200
        assert coordinator.state.api_keys.items() == [(key_digest(ADMIN), "admin")]  # a digest, not the key
    finally:
        loop.run(coordinator.stop(grace_s=0.5))
        loop.close()
