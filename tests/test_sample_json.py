"""The fast per-sample JSON equals ``json.dumps(indent=4, default=str)`` byte for byte."""

from __future__ import annotations

import datetime
import json
import random

import pytest

from shardprep.sample_json import dumps_indented

TRICKY = ["", "caption with \"quotes\" and \\ and\nnewline", "é 键 😀", "\x00\x1f\x7f", ",\n    ", "}"]


def _value(rng: random.Random):
    return rng.choice([
        lambda: rng.choice(TRICKY),
        lambda: rng.randint(-2**70, 2**70),
        lambda: rng.random() * 10 ** rng.randint(-30, 30),
        lambda: rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e16]),
        lambda: rng.choice([True, False, None]),
    ])()


@pytest.mark.parametrize("seed", range(20))
def test_flat_metadata_matches_json_dumps(seed):
    rng = random.Random(seed)
    meta = {rng.choice(TRICKY) + str(i): _value(rng) for i in range(rng.randint(1, 25))}
    assert dumps_indented(meta) == json.dumps(meta, indent=4, default=str)


@pytest.mark.parametrize("meta", [{}, {"a": [1, 2], "b": {"c": None}}, {"when": datetime.date(2026, 11, 25)},
                                  {1: "int key"}, {"x": (1, "t")}])
def test_anything_else_goes_through_json_dumps(meta):
    assert dumps_indented(meta) == json.dumps(meta, indent=4, default=str)
