"""lpx: log-prob cross-benchmark of rollout and training engines."""

__version__ = "0.1.0"
