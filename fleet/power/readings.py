"""Whether a BMC's power reading can be believed (pure, no I/O).

A BMC that answers nonsense watts must never move a rack's measured draw: a negative figure or
NaN would hide real load from the budget and the cap valve; a figure far above anything the
server can draw (a unit mix-up such as mW for W, a sensor stuck at its maximum raw value, a
firmware bug) would cap a whole rack for nothing. The caller (the reconciler) drops such a
reading, records an Event with the reason, and treats the server as having no reading (the
agent-based estimate stands in).

A reading between max_w and 10 × max_w is believed: nameplate figures are conservative but a
server past its nameplate is worth seeing, not hiding. Only the factor of ten marks nonsense.
"""

from __future__ import annotations

import math

__all__ = ["NONSENSE_FACTOR", "check_watts"]

# Above this multiple of the server's max_w a reading is nonsense (the "above 10× max").
NONSENSE_FACTOR = 10.0


def check_watts(watts: object, *, max_w: float) -> str | None:
    """None when `watts` is a believable draw for a server whose maximum is `max_w`; else a
    one-line reason naming the figure (for the Event and the log).

    Nonsense: not a number (bool included), NaN or infinite, negative, or above
    NONSENSE_FACTOR × max_w. Zero is believable (a server on a dead PSU feed, or fully off).
    A max_w that is not a positive number leaves only the sign and finiteness checks."""
    if isinstance(watts, bool) or not isinstance(watts, int | float):
        return f"the reading {watts!r} is not a number of watts"
    value = float(watts)
    if math.isnan(value) or math.isinf(value):
        return f"the reading {value} W is not a finite number"
    if value < 0:
        return f"the reading {value:g} W is negative"
    if isinstance(max_w, int | float) and math.isfinite(max_w) and max_w > 0:
        limit = NONSENSE_FACTOR * float(max_w)
        if value > limit:
            return (
                f"the reading {value:g} W is above {NONSENSE_FACTOR:g} × the server's maximum "
                f"of {float(max_w):g} W"
            )
    return None
