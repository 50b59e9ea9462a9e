"""The fleet's state: `FleetState` (base.py) and its implementations, in memory (memory.py, the
default)."""
from __future__ import annotations

from coordinator.state.base import FleetState, NotLive, Placement
from coordinator.state.memory import MemoryState

__all__ = ["FleetState", "MemoryState", "NotLive", "Placement"]
