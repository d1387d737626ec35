"""The token count of a prompt, one rule for the engine and the router.

The stand-in engine (fleet_agent/engine/core.py) tokenizes this way, so for it the count is
exact; the router (fleet/router/tokens.py) estimates real models' prompts with the same rule
(OpenAI's rule of thumb of 4 characters per token). Pure: no I/O.
"""

from __future__ import annotations

import math

CHARS_PER_TOKEN = 4


def count_tokens(text: str) -> int:
    """Prompt tokens of `text`: ceil(characters / 4), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
