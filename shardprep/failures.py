"""Whether a recorded download failure may go away by itself (``transient``: try the row again later) or
not (``permanent``): one place that reads the engine's failure reasons (a parquet row's
``error_message``, a ``status_dict`` key).

Transient: timeouts, a connection refused, reset or cut off, a network or host unreachable, a
temporary DNS failure, HTTP 408, 425, 429, 500, 502, 503 and 504, a rate limit (Retry-After past the
deadline), an unreachable robots.txt. Permanent: every other HTTP status (400, 401, 403, 404, 410,
451, ...), not an image, a decode error, too large, refused by the address guard or the scheme,
robots.txt or X-Robots-Tag disallowed, a takedown, and any reason not known here: retrying blindly
costs the site requests, so only what is known to pass is retried.
"""

from __future__ import annotations

import re
from typing import Literal

from shardprep.robots import UNREACHABLE

Kind = Literal["transient", "permanent"]
TRANSIENT: Kind = "transient"
PERMANENT: Kind = "permanent"

TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})

# what fetch writes, with the variable parts as patterns (shardprep/fetch.py, shardprep/robots.py)
_HTTP_STATUS = re.compile(r"HTTP Error (\d{3})\b")
_TRANSIENT = re.compile(
    "|".join((
        r"timed out",  # "timed out"; "<urlopen error [Errno 110] Connection timed out>"; a TLS handshake's
        r"^rate limited \(",  # "rate limited (HTTP 429, Retry-After 3600 s)"
        # "<urlopen error [Errno 111] Connection refused>" and the like (urllib's wording of an OSError)
        r"^<urlopen error .*(?:Connection refused|Connection reset|Temporary failure in name resolution"
        r"|Network is unreachable|No route to host|Try again)",
        # "connection broken: RemoteDisconnected(...)": the connection was cut, not answered wrongly
        r"^connection broken: (?:RemoteDisconnected|IncompleteRead|ConnectionResetError|BrokenPipeError"
        r"|ConnectionAbortedError|ConnectionRefusedError)\(",
    )),
    re.IGNORECASE,
)


def classify(reason: str) -> Kind:
    """``transient`` or ``permanent`` for a failure reason (see the module's docstring)."""
    if reason.startswith(UNREACHABLE):  # any 5xx or a 429 for robots.txt: the site may be back soon
        return TRANSIENT
    status = _HTTP_STATUS.search(reason)
    if status is not None:
        return TRANSIENT if int(status.group(1)) in TRANSIENT_STATUSES else PERMANENT
    return TRANSIENT if _TRANSIENT.search(reason) else PERMANENT
