"""The state index (``shardprep.state``): it mirrors the stamps, keeps the last failure and the step at
work, survives kill -9 at any moment without claiming more than the stamps, and is made again from them."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardprep import state
from shardprep.layout import Layout
from shardprep.versions import read_stamp, remove_stamp, restamp_sizes, write_stamp

CHECKOUT = str(Path(__file__).resolve().parents[1])


def _write(layout: Layout, artifact: str, shard: str, version: str, size: int = 10) -> None:
    url = f"{layout.root}/{artifact}/{shard}.bin"
    write_stamp(layout, artifact, version, shard, {url: size})


def test_the_index_follows_stamps_failures_and_starts(tmp_path):
    layout = Layout(str(tmp_path))
    state.ensure(layout)  # as a run starts: an empty index
    _write(layout, "image_shards", "00000", "v1")
    _write(layout, "image_shards", "00001", "v1")
    state.record_started(layout, "image_shards", ["00002"])
    state.record_failed(layout, "image_shards", "00003", "ValueError: no rows")
    # read without folding: the journal applied in memory, nothing written
    before = state.load(layout, ["image_shards"], fold_first=False)["image_shards"]
    assert not Path(layout.state_table("image_shards")).exists()
    assert before.versions() == {"00000": "v1", "00001": "v1"}
    assert before.failures() == {"00003": "ValueError: no rows"}
    assert list(before.started()) == ["00002"] and before.started()["00002"][1] == state.worker()
    assert before.outputs("00000", layout) == {f"{layout.root}/image_shards/00000.bin": 10}

    assert state.fold(layout) == 4
    assert os.listdir(layout.state_journal) == []
    after = state.load(layout, ["image_shards"])["image_shards"]
    assert after.table.equals(before.table)
    assert state.fold(layout) == 0  # nothing new

    # a success clears the failure; a removal forgets completeness; a new version replaces the old
    _write(layout, "image_shards", "00003", "v1")
    remove_stamp(layout, "image_shards", "00001")
    _write(layout, "image_shards", "00000", "v2", size=12)
    now = state.load(layout, ["image_shards"])["image_shards"]
    assert now.versions() == {"00000": "v2", "00003": "v1"} and now.failures() == {}
    assert now.complete("v1") == {"00003"}
    assert now.outputs("00000", layout) == {f"{layout.root}/image_shards/00000.bin": 12}
    assert "00002" in now.started()  # started, no outcome yet
    assert state.stamps_equal_index(layout, ["image_shards"]) == {}


def test_folding_the_same_journal_twice_changes_nothing(tmp_path):
    layout = Layout(str(tmp_path))
    state.ensure(layout)
    for i in range(5):
        _write(layout, "clip_embeddings", f"{i:05d}", "v1")
    remove_stamp(layout, "clip_embeddings", "00002")
    journal = {p.name: p.read_bytes() for p in Path(layout.state_journal).iterdir()}
    state.fold(layout)
    once = state.load(layout, ["clip_embeddings"])["clip_embeddings"].table
    for name, data in journal.items():  # as if a fold had died after its tables, before its deletes
        Path(layout.state_journal, name).write_bytes(data)
    state.fold(layout)
    assert state.load(layout, ["clip_embeddings"])["clip_embeddings"].table.equals(once)
    assert state.stamps_equal_index(layout, ["clip_embeddings"]) == {}


def test_an_output_root_made_before_the_index_gets_one_from_its_stamps(tmp_path):
    layout = Layout(str(tmp_path))
    _write(layout, "source_parquet", "00000", "a")
    _write(layout, "source_parquet", "00001", "a")
    state.clear(layout)  # as a root written by an earlier release: stamps only
    assert state.load(layout, ["source_parquet"], fold_first=False)["source_parquet"].versions() == {}
    assert state.load(layout, ["source_parquet"])["source_parquet"].versions() == {"00000": "a", "00001": "a"}
    assert state.stamps_equal_index(layout, ["source_parquet"]) == {}


def test_a_root_with_nothing_recorded_gets_no_files(tmp_path):
    layout = Layout(str(tmp_path / "out"))
    assert state.load(layout, ["image_shards"])["image_shards"].versions() == {}
    assert not (tmp_path / "out").exists()


ARTIFACTS = ("image_shards", "clip_embeddings")

# What the processes killed below do: change stamps at random, as writers do (write, rewrite at another
# version, remove, re-record sizes), and fold the journal, as the run's process and `status` do.
WRITER = """
import random, sys
from shardprep.layout import Layout
from shardprep.versions import remove_stamp, restamp_sizes, write_stamp
layout, rng = Layout(sys.argv[1]), random.Random(int(sys.argv[2]))
print("ready", flush=True)
while True:
    artifact, shard = rng.choice({artifacts!r}), f"{{rng.randrange(12):05d}}"
    url = f"{{layout.root}}/{{artifact}}/{{shard}}.bin"
    op = rng.random()
    if op < 0.6:
        write_stamp(layout, artifact, rng.choice(["v1", "v2"]), shard, {{url: rng.randrange(100)}})
    elif op < 0.8:
        remove_stamp(layout, artifact, shard)
    else:
        restamp_sizes(layout, artifact, shard, {{url: rng.randrange(100)}})
""".format(artifacts=ARTIFACTS)
FOLDER = """
import sys
from shardprep import state
from shardprep.layout import Layout
layout = Layout(sys.argv[1])
print("ready", flush=True)
while True:
    state.fold(layout)
"""


def _start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=CHECKOUT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


@pytest.mark.parametrize("seed", range(6))
def test_kill_9_at_random_moments_never_leaves_the_index_claiming_more_than_the_stamps(tmp_path, seed):
    layout = Layout(str(tmp_path / "out"))
    rng = random.Random(seed)
    for round_ in range(3):
        procs = [_start(WRITER, layout.root, str(seed * 10 + round_)), _start(FOLDER, layout.root)]
        time.sleep(rng.uniform(0.05, 0.8))
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
        # what the index says complete is complete at that version (a shard whose journal entry was
        # lost between its stamp and the entry is shown missing, never the other way round)
        states = state.load(layout, ARTIFACTS, fold_first=rng.random() < 0.5)
        for artifact in ARTIFACTS:
            for shard, version in states[artifact].versions().items():
                stamp = read_stamp(layout, artifact, shard)
                assert stamp is not None and stamp["version"] == version, (round_, artifact, shard)
    # the journal applied by another fold after the kills is applied exactly once more, harmlessly; a
    # rebuild from the stamps makes it equal, field for field
    state.rebuild(layout)
    assert state.stamps_equal_index(layout, ARTIFACTS) == {}
    assert not [n for n in os.listdir(layout.state_journal) if not n.startswith(".")]


def test_restamped_sizes_reach_the_index(tmp_path):
    layout = Layout(str(tmp_path))
    _write(layout, "clip_embeddings", "00000", "v1", size=10)
    restamp_sizes(layout, "clip_embeddings", "00000", {f"{layout.root}/clip_embeddings/00000.bin": 11})
    st = state.load(layout, ["clip_embeddings"])["clip_embeddings"]
    assert st.outputs("00000", layout) == {f"{layout.root}/clip_embeddings/00000.bin": 11}
    assert state.stamps_equal_index(layout, ["clip_embeddings"]) == {}


def test_reading_and_folding_the_index_imports_no_pandas(tmp_path):
    """Every shard step reads the index (``complete_among``), ``status`` and the runner fold it: with
    ``pa.array`` of a list or ``Table.from_pylist`` each of those processes imported pandas (~0.2 CPU-s)."""
    code = (
        "import sys\nfrom shardprep import state\nfrom shardprep.layout import Layout\n"
        "from shardprep.versions import write_stamp\n"
        "layout = Layout(sys.argv[1])\nstate.ensure(layout)\n"
        "for k in ('00000', '00001'):\n"
        "    write_stamp(layout, 'image_shards', 'v1', k, {layout.root + '/image_shards/' + k + '.tar': 3})\n"
        "state.record_failed(layout, 'image_shards', '00002', 'boom')\n"
        "state.record_started(layout, 'image_shards', ['00003'])\n"
        "st = state.load(layout, ['image_shards'], fold_first=False)['image_shards']\n"  # the journal applied in memory
        "among = st.complete_among(['00000', '00002', '00009'], 'v1')\n"
        "folded = state.fold(layout)\n"
        "after = state.load(layout, ['image_shards'])['image_shards']\n"
        "print(sorted(among), folded, after.table.equals(st.table), sorted(after.failures()), 'pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=CHECKOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['00000']", "4", "True", "['00002']", "False"]
