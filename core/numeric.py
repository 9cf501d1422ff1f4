"""Small integer and ragged-array helpers the core (and plugins, through `plugin_api`) share."""

from __future__ import annotations

import numpy as np


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up (positive `b`)."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `a`."""
    return cdiv(a, multiple) * multiple


def cumsum_and_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[2,5,3] -> cumsum [2,7,10], arange within each count [0,1,0,1,2,3,4,0,1,2]."""
    cu = np.cumsum(counts)
    total = int(cu[-1]) if len(cu) else 0
    arange = np.arange(total) - np.repeat(cu - counts, counts)
    return cu, arange
