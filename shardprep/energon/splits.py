"""Which tars go to train, val and test (the package doc's split rule), and ``split.yaml``'s brace names."""

from __future__ import annotations

import hashlib
import re

from shardprep.energon.format import SPLIT_NAMES, EnergonIndexError


def normalised_ratio(split_ratio) -> tuple[float, float, float]:
    r = tuple(float(x) for x in split_ratio)
    if len(r) != 3 or any(x < 0 for x in r) or sum(r) <= 0:
        raise EnergonIndexError(f"split_ratio must be 3 non-negative numbers (train, val, test) with a positive "
                                f"sum, got {split_ratio!r}")
    total = sum(r)
    return tuple(x / total for x in r)  # type: ignore[return-value]


def check_patterns(split_patterns: dict[str, list[str]]) -> None:
    """Refuse anything but ``{split: [regex, ...]}`` with non-empty lists of valid regexes."""
    if not split_patterns or any(isinstance(v, str) or not v for v in split_patterns.values()):
        raise EnergonIndexError(f"split_patterns must map split names to non-empty lists of regexes, "
                                f"got {split_patterns!r}")
    for split, pats in split_patterns.items():
        for p in pats:
            try:
                re.compile(p)
            except re.error as e:
                raise EnergonIndexError(f"split_patterns[{split!r}]: bad regex {p!r} ({e})") from e


def _hash_fraction(name: str) -> float:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def assign_splits(tars: list[str], ratio: tuple[float, float, float] | None,
                  patterns: dict[str, list[str]] | None,
                  previous: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """``{split: [tars in order]}`` by the package's split rule; ``previous`` = tar -> splits to keep."""
    if patterns is not None:
        compiled = {split: [re.compile(p) for p in pats] for split, pats in patterns.items()}
        return {split: [t for t in tars if any(c.match(t) for c in cs)] for split, cs in compiled.items()}
    assert ratio is not None
    previous = previous or {}
    bounds = []
    acc = 0.0
    for r in ratio:
        bounds.append((acc, acc + r))
        acc += r
    where: dict[str, str] = {}
    for t in tars:
        old = previous.get(t)
        if old:
            where[t] = old[0]
            continue
        u = _hash_fraction(t)
        where[t] = next((SPLIT_NAMES[i] for i, (_, hi) in enumerate(bounds) if u < hi and ratio[i] > 0),
                        next(SPLIT_NAMES[i] for i in reversed(range(3)) if ratio[i] > 0))

    def members(split: str) -> list[str]:
        return [t for t in tars if where[t] == split]

    for i, split in enumerate(SPLIT_NAMES):
        if ratio[i] <= 0 or members(split):
            continue
        donors = sorted((s for s in SPLIT_NAMES if s != split and len(members(s)) > 1),
                        key=lambda s: -len(members(s)))
        if not donors:
            continue
        pool = members(donors[0])
        fresh = [t for t in pool if t not in previous]
        lo, hi = bounds[i]

        def distance(t: str) -> float:
            u = _hash_fraction(t)
            return 0.0 if lo <= u < hi else min(abs(u - lo), abs(u - hi))

        where[min(fresh or pool, key=lambda t: (distance(t), t))] = split
    return {split: members(split) for split in SPLIT_NAMES}


def collapse_names(names: list[str]) -> list[str]:
    """Brace-collapse runs of consecutive zero-padded numbers (``{00000..00002}.tar``), keeping order.

    Like energon's ``bracecollapse.collapse(..., keep_order=True)`` for the names shardprep writes;
    readers brace-expand split entries, and a name without a run is kept as is.
    """
    num_re = re.compile(r"^(.*?)(\d+)(\.tar)$")
    out: list[str] = []
    run: list[tuple[str, str, int, int]] = []  # (prefix, suffix, width, number)

    def flush() -> None:
        if not run:
            return
        p, s, w, first = run[0]
        last = run[-1][3]
        out.append(f"{p}{first:0{w}d}{s}" if len(run) == 1 else f"{p}{{{first:0{w}d}..{last:0{w}d}}}{s}")
        run.clear()

    for name in names:
        m = num_re.match(name)
        if m is None or "{" in name or "}" in name or "," in name:
            flush()
            out.append(name)
            continue
        p, digits, s = m.groups()
        cur = (p, s, len(digits), int(digits))
        if run and (run[-1][0], run[-1][1], run[-1][2]) == cur[:3] and run[-1][3] + 1 == cur[3]:
            run.append(cur)
        else:
            flush()
            run.append(cur)
    flush()
    return out
