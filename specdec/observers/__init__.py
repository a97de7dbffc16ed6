"""Observers watch the loop (stats, progress, traces) and never steer it."""

from .base import Observer
from .stats import StatsObserver

__all__ = ["Observer", "StatsObserver"]
