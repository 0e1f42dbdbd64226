"""What `shardprep run` does when the source is wrong or changes: a glob matching nothing and an
output_root that is a file fail at once (exit 2, naming them); appended rows become new shards and are
processed; a rewritten file stops the run with the reshard command, which redoes only changed shards."""

import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.layout import Layout
from shardprep.ledger import SourceChangedError, load_ledger
from shardprep_dagster.orchestration.reshard import reshard
from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_glob_matching_nothing_fails_at_once(tmp_path):
    config = write_config(tmp_path / "c.yaml", source=str(tmp_path / "src" / "*.parquet"),
                          output_root=str(tmp_path / "out"))
    start = time.monotonic()
    out = _cli("run", "--config", config, "--no-progress", home=tmp_path / "home")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "matched no file" in out.stderr and "*.parquet" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - start < 60  # generous: a Python start-up, no run (was 18 s into the global step)
    assert not (tmp_path / "out" / "balanced").exists()


def test_output_root_that_is_a_file_names_the_field(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "out").write_text("not a folder")
    config = write_config(tmp_path / "c.yaml", source=str(tmp_path / "src" / "*.parquet"),
                          output_root=str(tmp_path / "out"))
    out = _cli("run", "--config", config, home=tmp_path / "home")
    assert out.returncode == 2 and "'output_root'" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.fixture
def source(tmp_path, image_site, tiny_clip_dir):
    src = tmp_path / "source"
    [path] = synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[50], n_images=120,
                                            seed=6)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=20, image_size=32, allow_private_addresses=True, thread_count=8,
                          timeout=5, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16,
                          enable_nemo_text2img=False, enable_nemo_diffusion=False)
    return Path(path), config, Layout(str(tmp_path / "out")), image_site[1]


def _rewrite(path: Path, table: pa.Table) -> None:
    time.sleep(0.01)  # a new mtime even on coarse clocks
    pq.write_table(table, path)


def test_appended_rows_become_new_shards_and_are_processed(source):
    path, config, layout, base_url = source
    with dg.instance_for_test() as instance:
        first = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert first.ok and first.shards == ["00000", "00001", "00002"]  # 20 + 20 + 10 rows
        tars = {s: Path(layout.tar(s)).read_bytes() for s in first.shards}

        extra = synthetic.source_rows(base_url, 50, n_images=120, seed=7, start=50)
        table = pq.read_table(path)
        _rewrite(path, pa.concat_tables([table, pa.table(extra, schema=table.schema)]))
        second = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert second.ok, second.failed
        assert second.new_shards == ["00003", "00004", "00005"] and second.appended_sources
        ledger = load_ledger(layout)
        assert [ledger.shard(s).rows for s in second.shards] == [20, 20, 10, 20, 20, 10]  # the short shard stays
        assert (ledger.shard("00003").row_start, ledger.shard("00003").row_stop) == (50, 70)
        assert {s: Path(layout.tar(s)).read_bytes() for s in first.shards} == tars  # old shards untouched
        assert second.materialized["reordered_embeddings"] == 6 and second.runs == 4  # 3 new shards + global


def test_rewritten_file_needs_reshard_which_redoes_only_changed_shards(source):
    path, config, layout, _ = source
    with dg.instance_for_test() as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        table = pq.read_table(path).to_pydict()
        table["caption"][25] = "a caption rewritten after registration"  # a row of shard 00001
        _rewrite(path, pa.table(table, schema=pq.read_schema(path)))
        with pytest.raises(SourceChangedError) as e:
            run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert str(path) in str(e.value) and "shardprep reshard --config" in str(e.value)

        result = reshard(config, str(path), instance=instance)
        assert result.invalidated == ["00001"] and result.new_keys == []
        tars = {s: Path(layout.tar(s)).read_bytes() for s in ("00000", "00002")}
        again = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert again.ok and again.runs == 2  # shard 00001 and the global run
        assert {s: Path(layout.tar(s)).read_bytes() for s in ("00000", "00002")} == tars
        assert pq.read_table(layout.source_parquet("00001"))["caption"][5].as_py() == table["caption"][25]
