"""Lightning callbacks: throughput and training reports."""

from lightning_gem.callbacks.report import ThroughputReport

__all__ = ["ThroughputReport"]
