"""Arrow arrays from Python lists without pandas (``shardprep.arrow_lists``): the arrays ``pa.array`` gives."""

import math
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from shardprep import arrow_lists

STRINGS = [["a", None, "", "héllo wörld", "日本語", "x" * 1000], [None, None], [], ["only"], [""]]
INTEGERS = [[1, None, -5, 0], [None], [], [2**31 - 1, -(2**31)]]


@pytest.mark.parametrize("values", STRINGS)
def test_strings_are_pyarrows(values):
    got = arrow_lists.array(values, pa.string())
    got.validate(full=True)
    assert got.equals(pa.array(values, pa.string())) and got.null_count == values.count(None)


@pytest.mark.parametrize("values", INTEGERS)
@pytest.mark.parametrize("arrow_type", [pa.int32(), pa.int64()])
def test_integers_are_pyarrows(values, arrow_type):
    got = arrow_lists.array(values, arrow_type)
    got.validate(full=True)
    assert got.type == arrow_type and got.equals(pa.array(values, arrow_type))


@pytest.mark.parametrize("values", [[1.5, None, -0.0, float("inf"), 1e300, 5e-324], [None], [], [0.1]])
def test_floats_are_pyarrows(values):
    got = arrow_lists.array(values, pa.float64())
    got.validate(full=True)
    assert got.equals(pa.array(values, pa.float64())) and got.null_count == values.count(None)


def test_a_nan_stays_a_value_not_a_null():
    got = arrow_lists.array([float("nan"), None], pa.float64())
    assert got.null_count == 1 and math.isnan(got[0].as_py()) and not got[0].as_py() == got[0].as_py()


@pytest.mark.parametrize("values, arrow_type", [([2**31], pa.int32()), ([-1], pa.uint32()), ([2**64], pa.int64())])
def test_out_of_range_integers_fail_as_pyarrow_fails(values, arrow_type):
    # numpy 1.x would wrap 2**31 to -2**31 without a word: pyarrow's own conversion decides
    with pytest.raises((pa.ArrowInvalid, OverflowError)):
        pa.array(values, arrow_type)
    with pytest.raises((pa.ArrowInvalid, OverflowError)):
        arrow_lists.array(values, arrow_type)


@pytest.mark.parametrize("values, arrow_type", [
    ([1, None], pa.float64()), ([2**60 + 1], pa.float64()),  # ints in a float column: pyarrow's rules
    ([1.5, None], pa.float32()), ([True, None], pa.bool_()), ([[1, 2], None], pa.list_(pa.int64())),
    ([True, 2], pa.int64()),  # a bool among ints: pyarrow's rules, not ours
])
def test_other_values_go_to_pyarrow(values, arrow_type):
    try:
        want = pa.array(values, arrow_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
        with pytest.raises(type(e)):
            arrow_lists.array(values, arrow_type)
    else:
        assert arrow_lists.array(values, arrow_type).equals(want)


_STRING_COLUMNS = [pa.array(["v1", None, "v2", "v1"]), pa.chunked_array([["v1", None], [], ["v2", "v1"]]),
                   pa.array([], pa.string()), pa.array([None, None], pa.string())]


@pytest.mark.parametrize("column, value", [(c, v) for c in _STRING_COLUMNS for v in ("v1", "v3", None)]
                         + [(pa.array([1.5, None, 2.0]), v) for v in (1.5, 3.0, None)])
def test_value_masks_are_pyarrows_with_nulls_false(column, value):
    want = pc.fill_null(pc.equal(column, pa.scalar(value, column.type)), False)
    want_other = pc.fill_null(pc.not_equal(column, pa.scalar(value, column.type)), False)
    assert arrow_lists.is_value(column, value).to_pylist() == want.to_pylist()
    assert arrow_lists.is_other_value(column, value).to_pylist() == want_other.to_pylist()


def test_a_non_string_in_a_string_column_fails_as_pyarrow_fails():
    with pytest.raises(pa.ArrowTypeError):
        arrow_lists.array(["a", 3], pa.string())


def test_table_is_from_pydict():
    schema = pa.schema([("url", pa.string()), ("width", pa.int32()), ("score", pa.float32())],
                       metadata={b"k": b"v"})
    columns = {"url": ["u1", None, "u3"], "width": [256, None, 128], "score": [0.5, None, 1.0]}
    got = arrow_lists.table(columns, schema)
    assert got.equals(pa.Table.from_pydict(columns, schema=schema)) and got.schema.metadata == {b"k": b"v"}


def test_a_shard_parquet_is_written_without_importing_pandas(tmp_path):
    """A download process's one parquet would otherwise import pandas (0.27-0.35 CPU-seconds)."""
    code = (
        "import sys, pyarrow as pa\nfrom shardprep import arrow_lists\n"
        "from shardprep.config import config_from_dict\nfrom shardprep.images.shards import write_image_shard\n"
        "from shardprep.layout import Layout\nfrom shardprep.storage import read_parquet\n"
        "root = sys.argv[1]\n"
        "cfg = config_from_dict({'source': 'x', 'output_root': root, 'samples_per_shard': 10,"
        " 'allow_private_addresses': True, 'timeout': 2})\n"
        # unreachable URLs and a bad one: every row is written to the parquet, no network needed
        "urls = ['http://127.0.0.1:9/a.jpg', 'not a url', None]\n"
        "rows = arrow_lists.table({'url': urls, 'caption': ['c', None, 'é']},"
        " pa.schema([('url', pa.string()), ('caption', pa.string())]))\n"
        "r = write_image_shard(rows, 0, cfg, Layout(root))\n"
        "t = read_parquet(Layout(root).shard_parquet('00000'))\n"
        "print(r.count, t.column('caption').to_pylist() == ['c', None, 'é'], t.column('width').null_count,"
        " 'pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "True", "3", "False"]
