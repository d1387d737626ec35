"""Python's cycle collector paused around bulk work that makes no reference cycles.

Reference counting frees everything such work drops; the collector's full passes only walk a
heap that grows as the work goes on (an inventory of 10,000 servers, a simulation of 100,000
GPUs) and find nothing: measured, a third of a re-import (bench/inventory.py) and a quarter of
the 100,000-GPU simulation (bench/sim.py), with no object collected during either. The pause
is process-wide while it lasts; the caller that found the collector on turns it back on.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
