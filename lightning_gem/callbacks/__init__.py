"""Lightning callbacks: throughput and training reports."""

from lightning_gem.callbacks.mfu import MFUMonitor
from lightning_gem.callbacks.report import ThroughputReport

__all__ = ["MFUMonitor", "ThroughputReport"]
