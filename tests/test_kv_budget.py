"""The default KV budget: the device's usable memory, shared among the workers on it."""
from __future__ import annotations

from worker.engine import budget


def test_the_default_budget_is_shared_among_the_workers_of_a_device(monkeypatch):
    monkeypatch.setattr(budget, "usable_memory_bytes", lambda: 10 << 30)
    monkeypatch.setattr(budget.mx, "get_active_memory", lambda: 1 << 30)
    monkeypatch.delenv(budget.SHARE_ENV, raising=False)
    alone = budget.default_kv_budget_bytes()
    assert alone == int((10 << 30) * (1 - budget.MARGIN_FRACTION)) - (1 << 30)
    monkeypatch.setenv(budget.SHARE_ENV, "2")
    assert budget.default_kv_budget_bytes() == int((5 << 30) * (1 - budget.MARGIN_FRACTION)) - (1 << 30)
    monkeypatch.setenv(budget.SHARE_ENV, "junk")
    assert budget.default_kv_budget_bytes() == alone


def test_the_default_budget_has_a_floor(monkeypatch):
    monkeypatch.setattr(budget, "usable_memory_bytes", lambda: 1 << 30)
    monkeypatch.setattr(budget.mx, "get_active_memory", lambda: 2 << 30)
    assert budget.default_kv_budget_bytes() == budget.MIN_BUDGET_BYTES
