"""The engine's KV-transfer API (session migration): snapshot a running session's state, check an
incoming state's header and reserve KV budget for it, stage its bytes, drop it.

Each call runs as one function on the engine thread between two scheduler iterations (the
engine's `Call` command) and answers with a Future, so no caller waits for MLX. The state's
format is worker/engine/kv_transfer.py; imports wait for their claim in the scheduler's
`StagedImports` (worker/engine/imports.py).
"""
from __future__ import annotations

import uuid
from concurrent.futures import Future
from typing import Any, Callable, Optional

from worker.config import EngineConfig
from worker.engine import kv_transfer
from worker.engine.kv_transfer import FORMAT_VERSION, CacheBytes, SessionState
from worker.engine.scheduler import Scheduler
from worker.engine.types import StateMismatch, UnknownSession

EngineCall = Callable[[Callable[[Any, Scheduler], Any]], Future]


class SessionTransfer:
    """Exports and imports session states of one engine (`Engine.transfer`).

    Args:
        call: runs fn(models, scheduler) on the engine thread and returns a Future of its result;
            the Future fails with `Draining` while the engine is not serving.
        clock: the engine's monotonic clock, seconds.
        vocab_size: the target's vocabulary size (None: unknown, token ids go unchecked).

    Attributes:
        import_ttl_s: seconds an imported state waits for its claim before it is dropped.
        fingerprints: `kv_transfer.fingerprint` of the loaded "target" and DFlash "draft" ("" for
            none); set by the engine thread once the models load (`loaded`).
    """

    def __init__(self, call: EngineCall, clock: Callable[[], float], vocab_size: Optional[int]):
        self._call = call
        self._clock = clock
        self._vocab_size = vocab_size
        self.import_ttl_s = kv_transfer.DEFAULT_IMPORT_TTL_S
        self.fingerprints: dict[str, str] = {}

    def loaded(self, config: EngineConfig, draft_kind: str, sched: Scheduler) -> None:
        """Names the loaded models at the caches' dtype (engine thread, once): a state loads only
        where the same weights and dtype run."""
        dtype = str(sched.layouts["plain"][0][2])
        self.fingerprints = {"target": kv_transfer.fingerprint(config.model_path, dtype),
                             "draft": kv_transfer.fingerprint(config.draft_path, dtype)
                             if draft_kind == "dflash" else ""}

    def export_session(self, request_id: str) -> Future:
        """Snapshots a decoding session's state at its committed length; it keeps decoding.

        Returns:
            A Future of `kv_transfer.SessionState` (host bytes; resolved by the engine thread
            between two iterations). Its exception: `UnknownSession` (no such decoding session),
            `NotExportable` (a mode without exportable state) or `Draining`.
        """
        def run(m, sched: Scheduler) -> SessionState:
            mode, tokens, caches = sched.export(request_id)
            return SessionState(request_id, mode, tokens, len(tokens) - 1, caches,
                                self.fingerprints["target"],
                                self.fingerprints["draft"] if mode == "dflash" else "")
        return self._call(run)

    def reserve_import(self, header: SessionState) -> Future:
        """Checks an incoming state's header (`header.caches` hold layouts, no data) against this
        worker and reserves KV budget for it for `import_ttl_s` seconds.

        Returns:
            A Future of the import id. Its exception: `StateMismatch` (format version, model or
            draft fingerprint, mode, dtype or shapes differ: the message says which), `Overloaded`
            (it does not fit the KV budget now) or `Draining`.
        """
        def run(m, sched: Scheduler) -> str:
            if header.format_version != FORMAT_VERSION:
                raise StateMismatch(f"format version {header.format_version}, this worker reads {FORMAT_VERSION}")
            mine = self.fingerprints["target"]
            if header.model_fingerprint != mine:
                raise StateMismatch(f"model {header.model_fingerprint!r}, this worker runs {mine!r}")
            if header.mode == "dflash" and header.draft_fingerprint != self.fingerprints["draft"]:
                raise StateMismatch(f"draft {header.draft_fingerprint!r}, this worker's is "
                                    f"{self.fingerprints['draft']!r}")
            if len(header.tokens) != header.positions + 1:
                raise StateMismatch(f"{len(header.tokens)} tokens for {header.positions} positions")
            if self._vocab_size is not None and not all(0 <= t < self._vocab_size for t in header.tokens):
                raise StateMismatch(f"token ids outside this model's vocabulary [0, {self._vocab_size})")
            if any(lay.key_shape[2] != header.positions or lay.value_shape[2] != header.positions
                   for lay in header.layouts):
                raise StateMismatch(f"cache shapes other than {header.positions} positions")
            import_id = uuid.uuid4().hex
            sched.reserve_import(import_id, header.request_id, header.mode, header.positions, header.layouts,
                                 self._clock() + self.import_ttl_s)
            return import_id
        return self._call(run)

    def stage_import(self, import_id: str, tokens: tuple[int, ...], caches: list[CacheBytes]) -> Future:
        """Loads a reserved import's verified bytes into caches; a GenerationRequest naming
        `import_id` then claims them (`GenerationRequest.import_id`).

        Returns:
            A Future of None. Its exception: `UnknownSession` (the reservation expired or was
            dropped) or `Draining`; the import is dropped on any error.
        """
        def run(m, sched: Scheduler) -> None:
            imp = sched.imports.get(import_id)
            if imp is None:
                raise UnknownSession(f"import {import_id!r} expired or was dropped before its data arrived")
            try:
                sched.imports.stage(import_id, tokens, kv_transfer.restore(caches, imp.positions))
            except BaseException:
                sched.imports.drop(import_id)
                raise
        return self._call(run)

    def drop_import(self, import_id: str) -> None:
        """Forgets a reserved or staged import (no-op when unknown); never waits."""
        self._call(lambda m, sched: sched.imports.drop(import_id))
