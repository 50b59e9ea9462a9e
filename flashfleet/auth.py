"""Access control: API keys for clients, a join token for workers.

- API keys: clients send gRPC metadata `authorization: Bearer <key>` (the HTTP API: the header
  `Authorization: Bearer <key>`). The SDK and CLI send the key of `api_key=` or env
  `FLASHFLEET_API_KEY`. A coordinator with keys configured (`--api-keys-file`, env
  `FLASHFLEET_COORDINATOR_API_KEYS`) refuses its public Coordinator service to any other caller with
  UNAUTHENTICATED before the request is routed. Each key has a role, `client` (the default) or
  `admin`: the operator's calls, DrainWorker and MoveSession, need an `admin` key and refuse a
  client key with PERMISSION_DENIED (`RequireRole`; coordinator/server.py ADMIN_METHODS). Without keys configured every call is open.
- Join token: one shared secret (`--join-token-file`, env `FLASHFLEET_JOIN_TOKEN`) sent as
  metadata `x-flashfleet-join-token`. A coordinator with a token refuses Register / Heartbeat /
  Deregister without it; a worker with a token serves its Worker service only to a caller that
  presents it (the coordinator sends it on every worker call).

Secrets are compared in constant time (`hmac.compare_digest`) and never logged.
"""
from __future__ import annotations

import hmac
import os
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


def read_secrets_file(path: str | Path) -> list[str]:
    """The secrets in a text file: one a line, blank lines and `#` comments skipped.

    Raises:
        OSError: the file cannot be read.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [s for s in (line.split("#", 1)[0].strip() for line in lines) if s]


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
    Empty: no key required.

    Raises:
        OSError: `path` cannot be read.
        ValueError: an entry with an unknown role or more than two words (`parse_api_key`).
    """
    env = os.environ if env is None else env
    entries = read_secrets_file(path) if path else []
    entries += [k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
    keys: dict[str, str] = {}
    for entry in entries:
        key, role = parse_api_key(entry)
        keys[key] = role
    return keys


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


class RequireRole(grpc.aio.ServerInterceptor):
    """Refuses calls to `methods` (full method names, "/package.Service/Method") with
    PERMISSION_DENIED unless their `authorization: Bearer <key>` carries one of `accepted` (the
    keys with the role); other methods pass. Runs after `RequireSecret`, so an unknown key was
    already refused UNAUTHENTICATED. The refused call never reaches its servicer."""

    def __init__(self, methods: Iterable[str], accepted: Iterable[str], role: str):
        self._methods, self._accepted, self._role = frozenset(methods), tuple(accepted), role

    def allows(self, metadata) -> bool:
        """True when the call's metadata carries a key with the role."""
        value = next((v for k, v in metadata or () if k == AUTHORIZATION), None)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return matches(bearer(value), self._accepted)

    async def intercept_service(self, continuation, handler_call_details):
        """The method's handler, or for a guarded method without a key of the role one that
        aborts with PERMISSION_DENIED."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods or self.allows(handler_call_details.invocation_metadata):
            return handler
        details = (f"{method.rsplit('/', 1)[-1]} needs an API key with the {self._role} role and this key has "
                   f"another: use an {self._role} key (a line '<key> {self._role}' in the coordinator's "
                   "api_keys_file)")

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, details)

        kind = (("stream_" if handler.request_streaming else "unary_")
                + ("stream" if handler.response_streaming else "unary"))
        return handler._replace(**{kind: refuse})


def is_loopback(host: str) -> bool:
    """True for a bind address only this machine can reach."""
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
