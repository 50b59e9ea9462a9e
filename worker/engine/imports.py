"""Imported session states waiting for their claim, within the KV budget (engine thread).

An import is reserved when its header arrives (its layouts checked against this worker's, its
bytes counted against the KV budget by the scheduler), staged when its caches arrive
(`kv_transfer.restore`), and then either claimed by the one request naming it, dropped (a
refused request, a Cancel of its request, a failed transfer) or expired unclaimed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from worker.caches.rows import RowKVCache
from worker.engine.kv_transfer import Layout
from worker.engine.types import StateMismatch, UnknownSession

log = logging.getLogger(__name__)


@dataclass
class StagedImport:
    """An imported state on the destination's scheduler, from reservation to claim.

    Attributes:
        import_id: what a GenerateRequest names to claim it.
        request_id: its session's request (a Cancel of it drops the import).
        mode: "plain" or "dflash".
        positions: positions its caches hold.
        nbytes: KV bytes reserved for it (its caches at their buffer size).
        expires_s: clock time after which it is dropped unclaimed.
        tokens: the token ids its caches cover (None until staged).
        caches: its one-row caches, target then draft (None until staged).
    """

    import_id: str
    request_id: str
    mode: str
    positions: int
    nbytes: int
    expires_s: float
    tokens: Optional[tuple[int, ...]] = None
    caches: Optional[list[RowKVCache]] = None


class StagedImports:
    """The imports one scheduler holds, by import id.

    Args:
        layouts: per mode this worker decodes ("plain", "dflash"), `Layout.per_position` of each of
            a session's caches, target then draft (what an import's layouts must equal).
        clock: monotonic seconds (the clock of the imports' `expires_s`).
    """

    def __init__(self, layouts: Mapping[str, list[tuple]], clock: Callable[[], float]):
        self.layouts = layouts
        self.clock = clock
        self._imports: dict[str, StagedImport] = {}

    def __len__(self) -> int:
        return len(self._imports)

    def get(self, import_id: str) -> Optional[StagedImport]:
        """The import of that name (None when there is none)."""
        return self._imports.get(import_id)

    def nbytes(self, excluding: str = "") -> int:
        """KV bytes reserved for every import but `excluding` (an import id; "" for none)."""
        return sum(i.nbytes for k, i in self._imports.items() if k != excluding)

    def check(self, mode: str, positions: int, layouts: list[Layout]) -> None:
        """Checks that a state of `positions` positions with these cache layouts (target then
        draft) can decode here in `mode`.

        Raises:
            StateMismatch: positions < 1, a mode this worker cannot decode, or layouts (count,
                dtype, heads, head sizes) other than this worker's; the message says which.
        """
        if positions < 1:
            raise StateMismatch(f"a state of {positions} positions")
        mine = self.layouts.get(mode)
        if mine is None:
            raise StateMismatch(f"mode {mode!r}: this worker decodes {sorted(self.layouts)}")
        theirs = [lay.per_position() for lay in layouts]
        if len(theirs) != len(mine):
            raise StateMismatch(f"{len(theirs)} caches, this worker's {mode} sessions have {len(mine)}")
        for a, b in zip(theirs, mine):
            if a != b:
                raise StateMismatch(f"cache layout (part, layer, dtype, key shape, value shape) {a}, "
                                    f"this worker's {b}")

    def reserve(self, imp: StagedImport) -> StagedImport:
        """Holds a reservation (its data not here yet); an import of the same name is replaced."""
        self._imports[imp.import_id] = imp
        return imp

    def stage(self, import_id: str, tokens: tuple[int, ...], caches: list[RowKVCache]) -> None:
        """Attaches an arrived state's caches (from `kv_transfer.restore`) to its reservation.

        Raises:
            UnknownSession: the reservation is gone (expired or dropped).
        """
        imp = self._imports.get(import_id)
        if imp is None:
            raise UnknownSession(f"import {import_id!r} expired or was dropped before its data arrived")
        imp.tokens, imp.caches = tuple(tokens), caches

    def drop(self, import_id: str) -> bool:
        """Forgets a staged or reserved import; False when there is none of that name."""
        return self._imports.pop(import_id, None) is not None if import_id else False

    def drop_request(self, request_id: str) -> int:
        """Forgets every import of a request; returns how many."""
        gone = [k for k, i in self._imports.items() if i.request_id == request_id]
        for k in gone:
            del self._imports[k]
        return len(gone)

    def clear(self) -> None:
        """Forgets every import."""
        self._imports.clear()

    def expire(self) -> int:
        """Drops imports past their expiry; returns how many."""
        now = self.clock()
        gone = [k for k, i in self._imports.items() if i.expires_s <= now]
        for k in gone:
            log.info("import %s of request %s expired unclaimed", k, self._imports[k].request_id)
            del self._imports[k]
        return len(gone)

    def next_expiry_in(self) -> Optional[float]:
        """Seconds until the next import expires (None when none is held)."""
        if not self._imports:
            return None
        return max(0.0, min(i.expires_s for i in self._imports.values()) - self.clock())

    def claim(self, import_id: str, request_id: str, mode: str,
              tokens: list[int]) -> tuple[Optional[list[RowKVCache]], int]:
        """Takes the import `import_id` for a request of `mode` whose committed tokens are
        `tokens`: its caches cut to the longest prefix of the tokens they cover (at most all but
        the last token), and that prefix's length. The import is gone afterwards in every case.

        Returns:
            (caches, positions); (None, 0) when there is no such import, it is not staged, its
            mode differs, or it shares no prefix with the tokens.
        """
        imp = self._imports.pop(import_id, None) if import_id else None
        if imp is None or imp.caches is None:
            return None, 0
        if imp.mode != mode:
            log.info("request %s: its imported state is %s, the request decodes %s: prefilling",
                     request_id, imp.mode, mode)
            return None, 0
        same = 0
        for a, b in zip(imp.tokens, tokens):
            if a != b:
                break
            same += 1
        usable = min(same, imp.positions, len(tokens) - 1)
        if usable < 1:
            log.info("request %s: its imported state's tokens are not its own: prefilling", request_id)
            return None, 0
        for c in imp.caches:
            c.trim(c.host_lengths[0] - usable)
        return imp.caches, usable
