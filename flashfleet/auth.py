"""Access control: API keys for clients, a join token for workers.

- API keys: clients send gRPC metadata `authorization: Bearer <key>` (the HTTP API: the header
  `Authorization: Bearer <key>`). The SDK and CLI send the key of `api_key=` or env
  `FLASHFLEET_API_KEY`. A coordinator with keys configured (`--api-keys-file`, env
  `FLASHFLEET_COORDINATOR_API_KEYS`) refuses its public Coordinator service to any other caller with
  UNAUTHENTICATED before the request is routed. Each key has a role, `client` (the default) or
  `admin`: the operator's calls (DrainWorker, MoveSession, PutApiKey, DeleteApiKey) need an
  `admin` key and refuse a client key with PERMISSION_DENIED (`RequireApiKey`;
  coordinator/server.py ADMIN_METHODS). Without keys every call is open. A coordinator holds keys
  as SHA-256 digests with their roles (`ApiKeys`): its keys file's seed the fleet's state
  (coordinator/state/), where PutApiKey adds more, so coordinators sharing the state in etcd
  accept the same keys, and no store holds a raw key.
- Join token: one shared secret (`--join-token-file`, env `FLASHFLEET_JOIN_TOKEN`) sent as
  metadata `x-flashfleet-join-token`. A coordinator with a token refuses Register / Heartbeat /
  Deregister without it; a worker with a token serves its Worker service only to a caller that
  presents it (the coordinator sends it on every worker call).

The join token is compared in constant time (`hmac.compare_digest`); an API key is looked up by
its SHA-256 digest (which reveals nothing usable of a long random key). Secrets are never logged.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import grpc

API_KEYS_ENV = "FLASHFLEET_COORDINATOR_API_KEYS"  # coordinator: the keys it accepts, comma-separated, each "<key>" or "<key> <role>"
API_KEY_ENV = "FLASHFLEET_API_KEY"  # clients (SDK, CLI): the one key they send
JOIN_TOKEN_ENV = "FLASHFLEET_JOIN_TOKEN"
AUTHORIZATION = "authorization"
JOIN_TOKEN_HEADER = "x-flashfleet-join-token"
BAD_KEY = "missing or wrong API key"
BAD_JOIN_TOKEN = "missing or wrong join token"
ROLES = ("client", "admin")  # what a key may do: call the public API; also drain workers and move sessions


def numbered_secrets(path: str | Path) -> list[tuple[int, str]]:
    """(line number from 1, secret) of each secret in a text file: one a line, blank lines and
    `#` comments skipped.

    Raises:
        OSError: the file cannot be read.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [(n, s) for n, s in enumerate((line.split("#", 1)[0].strip() for line in lines), 1) if s]


def read_secrets_file(path: str | Path) -> list[str]:
    """The secrets in a text file (`numbered_secrets`), in file order.

    Raises:
        OSError: the file cannot be read.
    """
    return [secret for _, secret in numbered_secrets(path)]


def parse_api_key(entry: str) -> tuple[str, str]:
    """(key, role) of one API key entry, "<key>" (role "client") or "<key> <role>".

    Raises:
        ValueError: more than two words, or a role not in ROLES (the message names the entry's
            role, never the key).
    """
    words = entry.split()
    if not words or len(words) > 2:
        raise ValueError(f"an API key entry is '<key>' or '<key> <role>' ({'|'.join(ROLES)}); got {len(words)} words")
    role = words[1] if len(words) == 2 else "client"
    if role not in ROLES:
        raise ValueError(f"unknown API key role {role!r}: use one of {', '.join(ROLES)}")
    return words[0], role


def load_api_keys(path: str | Path | None = None, env: dict | None = None) -> dict[str, str]:
    """The coordinator's API keys and their roles (key -> "client" or "admin", in file order):
    the entries of `path` (`read_secrets_file`; one a line, "<key>" or "<key> admin") plus the
    comma-separated entries in env FLASHFLEET_COORDINATOR_API_KEYS. A key given twice keeps its last role.
    Empty: no key required (no `path`, and none in the environment).

    Raises:
        OSError: `path` cannot be read.
        ValueError: `path` holds no key (a file given for keys that has none would leave the
            coordinator open), or an entry has an unknown role or more than two words
            (`parse_api_key`; the message names the file and line, or the variable and entry).
    """
    env = os.environ if env is None else env
    entries = [(f"{path}, line {n}", e) for n, e in numbered_secrets(path)] if path else []
    if path and not entries:
        raise ValueError(f"{path} holds no API key: write one a line, '<key>' or '<key> admin' "
                         "(to require none, leave the API keys file out)")
    entries += [(f"{API_KEYS_ENV}, entry {n}", k) for n, k in
                enumerate((k.strip() for k in env.get(API_KEYS_ENV, "").split(",")), 1) if k]
    keys: dict[str, str] = {}
    for where, entry in entries:
        try:
            key, role = parse_api_key(entry)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        keys[key] = role
    return keys


def key_digest(key: str) -> str:
    """The SHA-256 digest of an API key, 64 lowercase hex digits: what coordinators store and
    compare (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()


DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class ApiKeys:
    """The API keys a coordinator accepts: SHA-256 digest (`key_digest`) -> role ("client" or
    "admin"). Empty: every call is open. The fleet's state keeps it (coordinator/state/: in
    etcd, every coordinator's copy follows the shared one)."""

    def __init__(self):
        self._roles: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._roles)

    def role(self, key: str | None) -> str | None:
        """The role of `key`, or None for no key or an unknown one."""
        return self._roles.get(key_digest(key)) if key else None

    def put(self, digest: str, role: str) -> None:
        """Accepts the key with `digest` in `role` (replacing its earlier role).

        Raises:
            ValueError: `digest` is not 64 lowercase hex digits, or `role` is not in ROLES.
        """
        check_key_entry(digest, role)
        self._roles[digest] = role

    def remove(self, digest: str) -> bool:
        """Stops accepting the key with `digest`; True when it was accepted."""
        return self._roles.pop(digest, None) is not None

    def clear(self) -> None:
        """Forgets every key."""
        self._roles.clear()

    def items(self) -> list[tuple[str, str]]:
        """(digest, role) of every key."""
        return list(self._roles.items())


def check_key_entry(digest: str, role: str) -> None:
    """Raises ValueError unless `digest` is 64 lowercase hex digits and `role` is in ROLES."""
    if not DIGEST_RE.fullmatch(digest):
        raise ValueError("an API key's digest is its SHA-256 as 64 lowercase hex digits")
    if role not in ROLES:
        raise ValueError(f"unknown API key role {role!r}: use one of {', '.join(ROLES)}")


def load_join_token(path: str | Path | None = None, env: dict | None = None) -> str | None:
    """The join token: the first secret in `path`, else env FLASHFLEET_JOIN_TOKEN, else None.

    Raises:
        OSError: `path` cannot be read.
        ValueError: `path` holds no token.
    """
    env = os.environ if env is None else env
    if path:
        secrets = read_secrets_file(path)
        if not secrets:
            raise ValueError(f"{path} holds no join token")
        return secrets[0]
    return env.get(JOIN_TOKEN_ENV, "").strip() or None


def client_api_key(api_key: str | None = None, env: dict | None = None) -> str | None:
    """The key a client sends: `api_key`, else env FLASHFLEET_API_KEY, else None."""
    env = os.environ if env is None else env
    return api_key or env.get(API_KEY_ENV, "").strip() or None


def access_summary(api_keys: Sequence[str], join_token: str | None, tls: bool) -> str:
    """One log line saying which protections a server has on (never the secrets themselves),
    e.g. "access control: API keys on (2 keys), join token on, TLS off"."""
    keys = f"on ({len(api_keys)} key{'s' if len(api_keys) != 1 else ''})" if api_keys else "off"
    return (f"access control: API keys {keys}, join token {'on' if join_token else 'off'}, "
            f"TLS {'on' if tls else 'off'}")


def access_warnings(host_is_loopback: bool, api_keys: Sequence[str], join_token: str | None,
                    tls: bool) -> list[str]:
    """Warnings for a coordinator that others can reach (a non-loopback `host`): no API keys and
    no TLS (anyone may send requests), no join token (anyone may register a worker and receive
    prompts). Empty on a loopback host."""
    if host_is_loopback:
        return []
    out = []
    if not api_keys and not tls:
        out.append("neither API keys nor TLS: anyone who can reach this coordinator may use it "
                   "(--api-keys-file; docs/operations.md, section 9)")
    if not join_token:
        out.append("no join token: anyone who can reach this coordinator may register a worker and "
                   "receive prompts (--join-token-file; docs/operations.md, section 9)")
    return out


def matches(given: str | None, accepted: Iterable[str]) -> bool:
    """True when `given` equals one of `accepted`; each comparison takes constant time."""
    if not given:
        return False
    ok = False
    for secret in accepted:
        ok |= hmac.compare_digest(given.encode(), secret.encode())
    return ok


def bearer(value: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value (None when the value is not one)."""
    if not value:
        return None
    scheme, _, key = value.strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class _MetadataStub:
    """A stub whose every method sends `metadata` (see `with_metadata`)."""

    def __init__(self, stub, metadata: tuple[tuple[str, str], ...]):
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        def call(request, **kwargs):
            kwargs["metadata"] = tuple(kwargs.get("metadata") or ()) + self._metadata
            return method(request, **kwargs)
        return call


def with_metadata(stub, metadata: Sequence[tuple[str, str]]):
    """`stub` (a generated gRPC stub, sync or asyncio) whose every call also sends `metadata`;
    `stub` itself when `metadata` is empty."""
    return _MetadataStub(stub, tuple(metadata)) if metadata else stub


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `api_key` (empty for None)."""
    return ((AUTHORIZATION, f"Bearer {api_key}"),) if api_key else ()


def join_token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries the join token (empty for None)."""
    return ((JOIN_TOKEN_HEADER, token),) if token else ()


class RequireSecret(grpc.aio.ServerInterceptor):
    """Refuses calls to `services` with UNAUTHENTICATED unless their metadata `header` carries
    one of `accepted` (with `is_bearer`, as `Bearer <secret>`); other services (health,
    reflection) pass. The refused call never reaches its servicer."""

    def __init__(self, services: Iterable[str], header: str, accepted: Iterable[str], details: str,
                 is_bearer: bool = False):
        self._prefixes = tuple(f"/{s}/" for s in services)
        self._header, self._accepted, self._details = header, tuple(accepted), details
        self._bearer = is_bearer

    def allows(self, metadata) -> bool:
        """True when the call's invocation metadata carries an accepted secret."""
        value = next((v for k, v in metadata or () if k == self._header), None)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return matches(bearer(value) if self._bearer else value, self._accepted)

    async def intercept_service(self, continuation, handler_call_details):
        """The method's handler, or for a guarded service without the secret one that aborts
        with UNAUTHENTICATED."""
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(self._prefixes)
                or self.allows(handler_call_details.invocation_metadata)):
            return handler
        details = self._details

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

        kind = (("stream_" if handler.request_streaming else "unary_")
                + ("stream" if handler.response_streaming else "unary"))
        return handler._replace(**{kind: refuse})


class RequireApiKey(grpc.aio.ServerInterceptor):
    """Guards `services` with the API keys of `keys` (`ApiKeys`, read at every call, so keys added
    or removed later count at once): while it holds any key, a call without `authorization:
    Bearer <an accepted key>` is refused UNAUTHENTICATED, and a call to one of `admin_methods`
    (full method names, "/package.Service/Method") with a key of another role PERMISSION_DENIED;
    with no key, every call passes. Other services (health, reflection) pass. A refused call never
    reaches its servicer."""

    def __init__(self, services: Iterable[str], admin_methods: Iterable[str], keys: ApiKeys):
        self._prefixes = tuple(f"/{s}/" for s in services)
        self._admin_methods, self._keys = frozenset(admin_methods), keys

    def refusal(self, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
        """(status, details) refusing a call to `method` with `metadata`, or None to let it pass."""
        if not self._keys or not method.startswith(self._prefixes):
            return None
        value = next((v for k, v in metadata or () if k == AUTHORIZATION), None)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        role = self._keys.role(bearer(value))
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED, BAD_KEY
        if method in self._admin_methods and role != "admin":
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"{method.rsplit('/', 1)[-1]} needs an API key with the admin role and this key has another: "
                "use an admin key (a line '<key> admin' in the coordinator's api_keys_file)")
        return None

    async def intercept_service(self, continuation, handler_call_details):
        """The method's handler, or one that aborts with the refusal (`refusal`)."""
        handler = await continuation(handler_call_details)
        refused = None if handler is None else self.refusal(handler_call_details.method,
                                                            handler_call_details.invocation_metadata)
        if refused is None:
            return handler
        code, details = refused

        async def refuse(request, context):
            await context.abort(code, details)

        kind = (("stream_" if handler.request_streaming else "unary_")
                + ("stream" if handler.response_streaming else "unary"))
        return handler._replace(**{kind: refuse})


def is_loopback(host: str) -> bool:
    """True for a bind address only this machine can reach."""
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
