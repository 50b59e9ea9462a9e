"""A small asyncio client for etcd's v3 API over grpc.aio: the KV, Lease and Watch calls the
fleet state uses (coordinator/state/etcd.py), on stubs generated from etcd's own protos
(protos/flashfleet/etcd/).

Several endpoints (the members of an etcd cluster): calls go to one, and on UNAVAILABLE the
next one is tried, so the death of one member (its leader included: the others elect another)
costs a retry, not an error. A watch that breaks resumes from the revision after the last one it
delivered, on whichever member answers.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc

from flashfleet.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc

log = logging.getLogger("flashfleet.coordinator.etcd")

CALL_TIMEOUT_S = 5.0  # one etcd call; a healthy member answers in milliseconds
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: the most writes one transaction may carry


class EtcdUnavailable(ConnectionError):
    """No etcd endpoint answered."""


class WatchCompacted(RuntimeError):
    """A watch's start revision was compacted away: the watcher must read the state anew."""


def endpoint_target(endpoint: str) -> str:
    """The gRPC target of an etcd endpoint: "http://h:2379" and "h:2379" both give "h:2379".

    Raises:
        ValueError: an https:// endpoint (this client speaks plaintext gRPC) or one without a port.
    """
    if endpoint.startswith("https://"):
        raise ValueError(f"etcd endpoint {endpoint!r}: TLS to etcd is not supported; give http://host:port")
    target = endpoint.removeprefix("http://").rstrip("/")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} must be host:port (or http://host:port)")
    return target


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a range or watch cover every key starting with `prefix`."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class Write:
    """One key's write in a batch (`EtcdClient.write_all`): a put of `value`, attached to
    `lease` (0: none), or a delete of the key when `value` is None."""

    key: bytes
    value: bytes | None = None
    lease: int = 0

    def op(self) -> rpc_pb2.RequestOp:
        """The write as a transaction's operation."""
        if self.value is None:
            return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=self.key))
        return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=self.key, value=self.value, lease=self.lease))


@dataclass(frozen=True)
class Event:
    """One watched change: `kind` "put" or "delete", the key, the new value (b"" for a delete),
    its lease (0: none) and the revision of the change."""

    kind: str
    key: bytes
    value: bytes
    lease: int
    revision: int


class EtcdClient:
    """asyncio etcd v3 client (KV, Lease, Watch) over one channel per endpoint.

    Args:
        endpoints: "host:port" or "http://host:port" of each etcd member (at least one).

    Raises:
        ValueError: no endpoint, or a malformed one (`endpoint_target`).
    """

    def __init__(self, endpoints: Sequence[str]):
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self._targets = [endpoint_target(e) for e in endpoints]
        self._channels = [grpc.aio.insecure_channel(t) for t in self._targets]
        self._current = 0
        self._keepalive_lock = asyncio.Lock()
        self._keepalive_call = None

    @property
    def targets(self) -> list[str]:
        """The endpoints' gRPC targets ("host:port"), in the order given."""
        return list(self._targets)

    async def close(self) -> None:
        """Closes every channel (open watches and keep-alives end)."""
        for ch in self._channels:
            await ch.close()

    def _stubs(self, i: int):
        ch = self._channels[i]
        return rpc_pb2_grpc.KVStub(ch), rpc_pb2_grpc.LeaseStub(ch), rpc_pb2_grpc.WatchStub(ch)

    async def _unary(self, service: int, method: str, request):
        """Calls `method` of stub `service` (0 KV, 1 Lease) on the current endpoint, moving on
        to the next one on UNAVAILABLE or a timeout (each endpoint tried once).

        Raises:
            EtcdUnavailable: no endpoint answered.
            grpc.aio.AioRpcError: etcd refused the call (e.g. NOT_FOUND: the lease is gone).
        """
        last: Exception | None = None
        for attempt in range(len(self._channels)):
            i = (self._current + attempt) % len(self._channels)
            try:
                result = await getattr(self._stubs(i)[service], method)(request, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = e
                continue
            self._current = i
            return result
        raise EtcdUnavailable(f"no etcd endpoint answered ({', '.join(self._targets)}): {last}")

    # KV
    async def get(self, key: bytes) -> kv_pb2.KeyValue | None:
        """The key's KeyValue (value, lease, revisions), or None."""
        resp = await self._unary(0, "Range", rpc_pb2.RangeRequest(key=key))
        return resp.kvs[0] if resp.kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[kv_pb2.KeyValue], int]:
        """Every key under `prefix` and the store's revision at the read."""
        resp = await self._unary(0, "Range", rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix)))
        return list(resp.kvs), resp.header.revision

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Writes a key (attached to `lease`, 0: none); returns the revision.

        Raises:
            grpc.aio.AioRpcError: NOT_FOUND when the lease has expired or was revoked.
        """
        resp = await self._unary(0, "Put", rpc_pb2.PutRequest(key=key, value=value, lease=lease))
        return resp.header.revision

    async def delete(self, key: bytes) -> int:
        """Deletes a key; returns how many keys went (0 or 1)."""
        return (await self._unary(0, "DeleteRange", rpc_pb2.DeleteRangeRequest(key=key))).deleted

    async def write_all(self, writes: Sequence[Write]) -> int:
        """Applies `writes` in one transaction: one round trip, all of them or none. etcd refuses
        a transaction that names a key twice or holds more than `MAX_TXN_OPS` operations.

        Returns:
            The store's revision after the writes.

        Raises:
            grpc.aio.AioRpcError: NOT_FOUND when a put's lease has expired or was revoked (then
                none of the writes took effect); INVALID_ARGUMENT for a repeated key or too many.
            EtcdUnavailable: no endpoint answered.
        """
        resp = await self._unary(0, "Txn", rpc_pb2.TxnRequest(success=[w.op() for w in writes]))
        return resp.header.revision

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> tuple[bool, bytes]:
        """Writes a key only if it does not exist (a compare-and-swap on its create revision).

        Returns:
            (True, value) when this call created it, else (False, the value it holds).
        """
        txn = rpc_pb2.TxnRequest(
            compare=[rpc_pb2.Compare(result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.CREATE, key=key,
                                     create_revision=0)],
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))])
        resp = await self._unary(0, "Txn", txn)
        if resp.succeeded:
            return True, value
        kvs = resp.responses[0].response_range.kvs
        return False, kvs[0].value if kvs else b""

    async def delete_if(self, key: bytes, value: bytes) -> bool:
        """Deletes a key only while it holds `value`; True when it did."""
        txn = rpc_pb2.TxnRequest(
            compare=[rpc_pb2.Compare(result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.VALUE, key=key,
                                     value=value)],
            success=[rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))])
        return (await self._unary(0, "Txn", txn)).succeeded

    # Lease
    async def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds (etcd may raise it to its minimum); returns its id."""
        return (await self._unary(1, "LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=ttl_s))).ID

    async def revoke(self, lease: int) -> None:
        """Revokes a lease, deleting every key attached to it (a no-op when it is gone already)."""
        try:
            await self._unary(1, "LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def keepalive(self, lease: int) -> int:
        """Renews a lease once; returns its new TTL in seconds, 0 when it has expired.

        Keep-alives share one LeaseKeepAlive stream (etcd's own clients do the same), reopened on
        the next endpoint when it breaks.

        Raises:
            EtcdUnavailable: no endpoint answered.
        """
        async with self._keepalive_lock:
            for attempt in range(len(self._channels) + 1):
                if self._keepalive_call is None:
                    i = (self._current + max(0, attempt - 1)) % len(self._channels)
                    self._keepalive_call = self._stubs(i)[1].LeaseKeepAlive()
                call = self._keepalive_call
                try:
                    await asyncio.wait_for(call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease)), CALL_TIMEOUT_S)
                    resp = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
                    if resp is grpc.aio.EOF:
                        raise EOFError("the keep-alive stream ended")
                    return resp.TTL
                except (grpc.aio.AioRpcError, asyncio.TimeoutError, EOFError, asyncio.InvalidStateError) as e:
                    log.debug("etcd keep-alive stream broke (%s); reopening", e)
                    call.cancel()
                    self._keepalive_call = None
            raise EtcdUnavailable(f"no etcd endpoint renewed lease {lease:x} ({', '.join(self._targets)})")

    # Watch
    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[Event]]:
        """Yields the changes under `prefix` from `start_revision` on, one list per etcd
        response, forever: a broken stream is reopened (on the next endpoint when its own is
        down) from the revision after the last one delivered.

        Raises:
            WatchCompacted: etcd compacted the history past the revision to resume from.
        """
        next_rev = start_revision
        attempt = 0
        while True:
            i = (self._current + attempt) % len(self._channels)
            call = self._stubs(i)[2].Watch()
            try:
                await call.write(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(
                    key=prefix, range_end=prefix_end(prefix), start_revision=next_rev)))
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        raise EOFError("the watch stream ended")
                    attempt = 0
                    if resp.compact_revision:
                        raise WatchCompacted(f"revision {next_rev} was compacted (now {resp.compact_revision})")
                    if resp.canceled:
                        raise EOFError(f"etcd cancelled the watch: {resp.cancel_reason}")
                    if not resp.events:
                        continue
                    events = [Event("delete" if ev.type == kv_pb2.Event.DELETE else "put", ev.kv.key, ev.kv.value,
                                    ev.kv.lease, ev.kv.mod_revision) for ev in resp.events]
                    next_rev = events[-1].revision + 1
                    yield events
            except (grpc.aio.AioRpcError, EOFError, grpc.aio.UsageError) as e:
                attempt += 1
                log.warning("etcd watch on %s broke (%s); resuming from revision %d", self._targets[i], e, next_rev)
                await asyncio.sleep(min(1.0, 0.1 * attempt))
            finally:
                call.cancel()
