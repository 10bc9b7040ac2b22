"""Host memory of this process: current resident set, its peak, and a reset.

The current RSS comes from psutil. psutil (7.x) has no peak RSS on Linux
(its peak fields are Windows-only) and no way to reset one, so the peak is
the kernel's high-water mark `VmHWM`, read from `/proc/self/status`, and
`reset_host_peak_rss` rewinds it by writing to `/proc/self/clear_refs`.
Outside Linux the peak is `getrusage`'s `ru_maxrss`, which cannot be reset.

Example:

```python
from keras_hub_dist.measure import host_rss

host_rss.reset_host_peak_rss()
before = host_rss.current_rss_bytes()
data = bytearray(256 * 2**20)
growth = host_rss.host_peak_rss_bytes() - before  # about 256 MiB
```
"""

from __future__ import annotations

import os
import sys

import psutil

__all__ = ["anon_rss_bytes", "current_rss_bytes", "host_peak_rss_bytes", "reset_host_peak_rss"]

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"
# Written to clear_refs, "5" resets the peak RSS to the current RSS (and
# nothing else); see proc(5).
_RESET_PEAK_RSS = "5"

_process: psutil.Process | None = None


def _this_process() -> psutil.Process:
    """This process's `psutil.Process`, made once per pid.

    A `psutil.Process` is bound to the pid it was made in: one made before a
    fork would go on reporting the parent.
    """
    global _process
    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return _process


def current_rss_bytes() -> int:
    """The process's current resident set in bytes (0 if unknown)."""
    try:
        return int(_this_process().memory_info().rss)
    except psutil.Error:
        return 0


def _read_status_kib(field: str) -> int | None:
    """A KiB field of `/proc/self/status` (e.g. `VmHWM`); None outside Linux."""
    try:
        with open(_PROC_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def anon_rss_bytes() -> int:
    """The process's resident anonymous memory (`RssAnon`) in bytes: what
    it allocated, without the file pages it maps; 0 outside Linux."""
    kib = _read_status_kib("RssAnon")
    return 0 if kib is None else kib * 1024


def host_peak_rss_bytes() -> int:
    """The process's peak resident set (`VmHWM`) in bytes.

    Outside Linux: `getrusage` `ru_maxrss` (which cannot be reset).
    """
    kib = _read_status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # macOS reports bytes, Linux and the BSDs KiB.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def reset_host_peak_rss() -> bool:
    """Rewinds `VmHWM` to the current RSS (writes "5" to /proc/self/clear_refs).

    Returns:
        Whether the reset happened (False outside Linux or without the right
        to write the file); the peak then covers the whole process lifetime.
    """
    try:
        with open(_PROC_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write(_RESET_PEAK_RSS)
        return True
    except OSError:
        return False
