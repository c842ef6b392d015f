"""What the benchmark scripts share: timing contenders in interleaved rounds, so that a slow spell
of a shared machine falls on all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def interleaved(
    contenders: dict[str, Callable[[], Any]], rounds: int, repeat: int, warmups: int = 1
) -> dict[str, float]:
    """Median seconds per call of each contender: ``rounds`` rounds, each calling every one
    ``repeat`` times in turn, after ``warmups`` untimed calls of each (preps, compilation)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for call in contenders.values():
        for _ in range(warmups):
            call()
    for _ in range(rounds):
        for name, call in contenders.items():
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            times[name].append((time.perf_counter() - start) / repeat)
    return {name: float(np.median(values)) for name, values in times.items()}
