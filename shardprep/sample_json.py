"""A sample's ``.json`` member as img2dataset writes it (``json.dumps(meta, indent=4)``), fast.

With ``indent`` Python's json module takes its pure-Python encoder, ~50 us for a sample's 15 fields:
more than the tar headers of the whole sample. A flat dict of scalars (every image and video sample's
metadata) comes out of the C encoder with the indented layout as its item separator; anything else
(nested values, other types) goes through ``json.dumps`` itself.
"""

from __future__ import annotations

import json

_SCALARS = (str, int, float, bool, type(None))
# indent=4 puts each item on its own line: for a flat dict that is exactly this separator
_FLAT = json.JSONEncoder(separators=(",\n    ", ": "))


def dumps_indented(meta: dict) -> str:
    """``json.dumps(meta, indent=4, default=str)``, byte for byte."""
    if meta and all(type(k) is str and type(v) in _SCALARS for k, v in meta.items()):
        return "{\n    " + _FLAT.encode(meta)[1:-1] + "\n}"
    return json.dumps(meta, indent=4, default=str)
