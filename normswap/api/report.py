"""Reports as strict JSON: what ``--report`` files hold."""

from __future__ import annotations

import json
import math
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float as the string 'inf', '-inf' or 'nan' (strict JSON has none),
    tuples as lists and keys as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def to_json(data: Any) -> str:
    """``data`` as indented strict JSON text."""
    return json.dumps(jsonable(data), indent=2, allow_nan=False)
