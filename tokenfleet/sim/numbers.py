"""What a simulation config's numbers may be: finite (an infinite or NaN rate or duration hangs a run or poisons
its results) and, for counts, whole; never a boolean (YAML's true is an int to Python)."""

from __future__ import annotations

import math


def is_finite(value: object) -> bool:
    return not isinstance(value, bool) and (isinstance(value, int) or isinstance(value, float) and math.isfinite(value))


def is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
