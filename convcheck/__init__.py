"""convcheck: why does the same PyTorch model converge on one device and not on another?"""

from convcheck.errors import ConvcheckError, RunFailed, TargetUnavailable, UsageError

__version__ = "0.1.0"

__all__ = ["ConvcheckError", "RunFailed", "TargetUnavailable", "UsageError", "__version__"]
