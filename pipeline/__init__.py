"""lpx: log-prob cross-benchmark of rollout and training engines."""

__version__ = "0.1.0"

from pipeline import torchvision_guard  # noqa: E402

torchvision_guard.install()  # SGLang's torchvision beside a CPU torch; see the module
