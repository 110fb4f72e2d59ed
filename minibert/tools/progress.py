"""Progress bars: tqdm's when it is installed and asked for, else a silent stand-in with the same calls."""

from __future__ import annotations


class _Silent:
    def update(self, n=1):
        pass

    def close(self):
        pass


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "sent"):
    """A bar with ``update(n)`` and ``close()``: tqdm's (the ``progress`` extra) when ``enabled``."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, unit=unit)
        except ImportError:
            pass
    return _Silent()
