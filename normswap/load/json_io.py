"""The one JSON reader for files a user hands normswap (a model folder's config.json, its index and
normswap.json, safetensors headers): whatever the bytes, the answer is a value or one BadInputError.

json.loads recurses once per nesting level, so ``[[[[...]]]]`` 100,000 deep raises RecursionError (not
a ValueError), and a value a little less deep parses but breaks whatever walks it next (transformers'
config copies it recursively). No file normswap reads nests deeper than a few levels; past
:data:`MAX_DEPTH` it is refused as not being the file it claims to be.
"""

from __future__ import annotations

import json
from typing import Any

from normswap.errors import BadInputError, describe

# config.json nests a sub-config or two (text_config.rope_scaling...); safetensors headers three levels
MAX_DEPTH = 64


def _depth(value: Any) -> int:
    """How deep lists and objects nest in ``value``, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def parse_json(data: str | bytes, where: str, what: str) -> Any:
    """``data`` parsed; BadInputError naming ``where`` (the file) and ``what`` it should be when it is not
    JSON, or nests deeper than :data:`MAX_DEPTH`."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise BadInputError(
            f"{where} is not a valid {what}: it nests lists/objects too deeply to be one"
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInputError(f"{where} is not a valid {what}: {describe(exc)}") from None
    if _depth(value) > MAX_DEPTH:
        raise BadInputError(
            f"{where} is not a valid {what}: it nests lists/objects more than {MAX_DEPTH} levels deep"
        )
    return value
