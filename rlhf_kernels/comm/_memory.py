"""Peak resident-memory growth of this process (Linux), for memory tests and benchmarks.

``PeakRSS()`` starts measuring; ``stop()`` returns the peak RSS above the RSS at start, in
bytes. The peak is the larger of the kernel's high-water mark (``VmHWM``, reset at start through
``/proc/self/clear_refs`` where that is allowed) and a ~1 ms sampling thread (which is what
remains where the reset is not allowed). Before the baseline it runs the garbage collector and
gives freed heap pages back (``malloc_trim``), so earlier garbage is not counted as headroom.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time

__all__ = ["PeakRSS", "rss_bytes"]


def rss_bytes(field: str = "VmRSS") -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``...) in bytes; 0 if absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim() -> None:
    """Give freed heap pages back to the OS (glibc), so they do not hide the next peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak RSS growth (bytes) of this process from construction to ``stop()``."""

    def __init__(self, interval_s: float = 0.001):
        gc.collect()
        trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.hwm = True
        except OSError:
            self.hwm = False
        self.base = self.peak = rss_bytes()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self._interval)

    def stop(self) -> int:
        """Stop sampling; the peak RSS above the start, in bytes."""
        self._stop.set()
        self._thread.join()
        peak = max(self.peak, rss_bytes("VmHWM") if self.hwm else 0)
        return peak - self.base
