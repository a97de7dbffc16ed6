"""Observers watch the loop (stats, progress, traces) and never steer it."""

from ..core.components import Observer
from .phases import PhaseTimes
from .progress import ProgressObserver
from .stats import StatsObserver
from .trace import TraceObserver

__all__ = ["Observer", "PhaseTimes", "ProgressObserver", "StatsObserver", "TraceObserver"]
