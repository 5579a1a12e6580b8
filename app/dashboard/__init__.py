"""The dashboard window: one module per tab (overview, reuse, memory, cache, events, server)."""

from app.dashboard.base import Tab, ViewContext
from app.dashboard.window import Dashboard

__all__ = ["Dashboard", "Tab", "ViewContext"]
