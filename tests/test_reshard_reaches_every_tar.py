"""A row rewritten after its shard was made, settled with `shardprep reshard`: the next run replaces the
sample in every artifact that holds it -- the shard's image and diffusion tars, the balanced tar, its
precached encoding, wdinfo and both energon indexes -- and no byte of the old sample is left anywhere
under the output root. Before that run, `verify` names the global outputs that still hold the old one."""

import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardprep.keys import index_of_key
from shardprep.layout import Layout
from shardprep.ledger import load_ledger
from shardprep.nemo.balanced import load_state
from shardprep.tars import read_samples_by_key, sample_keys
from shardprep_dagster.definitions import build_defs
from shardprep_dagster.orchestration.reshard import reshard
from shardprep_dagster.orchestration.runner import run_pipeline
from shardprep_dagster.orchestration.verify import verify_dataset
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config

NEW_CAPTION = "a caption written after the shard was made"


@pytest.fixture
def dataset(tmp_path, image_site, tiny_clip_dir, tiny_nemo_dirs):
    src = tmp_path / "source"
    [path] = synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[30], n_images=120,
                                            seed=11)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=10, image_size=32, allow_private_addresses=True, thread_count=8,
                          timeout=5, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, tar_chunk_size=4,
                          precache_keep_original=True, **nemo_config(tiny_nemo_dirs))
    return Path(path), config, Layout(str(tmp_path / "out")), image_site[1]


def _files(root: str) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _balanced_holder(layout: Layout, key: str) -> int:
    return next(i for i in range(len(load_state(layout)["tars"])) if key in sample_keys(layout.balanced_tar(i)))


def test_a_resharded_row_leaves_no_old_byte_in_any_tar(dataset):
    path, config, layout, base_url = dataset
    with dg.instance_for_test() as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        table = pq.read_table(layout.shard_parquet("00001")).to_pandas()
        key = table[table.status == "success"]["key"].iloc[1]
        old = read_samples_by_key(layout.tar("00001"), {key})[key]
        holder = _balanced_holder(layout, key)
        assert old["txt"] in Path(layout.precached_tar(holder)).read_bytes()  # keep_original: the image and caption
        before = _files(layout.root)

        # the row, rewritten in place: another image (one no row uses) and another caption
        row = load_ledger(layout).shard("00001").row_start + index_of_key(key, 1)
        rows = pq.read_table(path).to_pydict()
        rows["url"][row], rows["caption"][row] = f"{base_url}/{synthetic.image_name(100)}", NEW_CAPTION
        time.sleep(0.01)
        pq.write_table(pa.table(rows, schema=pq.read_schema(path)), path)
        assert reshard(config, str(path), instance=instance).invalidated == ["00001"]

        # the shard made again on its own: every global output made from its old samples is named stale
        job = build_defs(config).resolve_job_def("shards_job")
        assert job.execute_in_process(partition_key="00001", instance=instance).success
        stale = verify_dataset(config, instance, mark=False)
        assert {p.artifact for p in stale.problems if p.stale} >= {
            "balanced_shards", "image_energon_index", "diffusion_energon_index"}, stale.summary()
        assert all(p.stale for p in stale.problems), stale.summary()
        assert f"{holder:05d}.tar" in stale.summary() and "shard 00001" in stale.summary()

        summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
        assert summary.ok, summary.failed
        assert verify_dataset(config, instance).ok

        after = _files(layout.root)
        for file, data in after.items():
            assert old["jpg"] not in data, f"{file} still holds the replaced image"
            if file.suffix == ".tar":
                assert old["txt"] not in data, f"{file} still holds the replaced caption"
        new = read_samples_by_key(layout.balanced_tar(_balanced_holder(layout, key)), {key})[key]
        assert new["txt"] == NEW_CAPTION.encode() and new["jpg"] != old["jpg"]
        assert NEW_CAPTION.encode() in Path(layout.precached_tar(_balanced_holder(layout, key))).read_bytes()
        # only the tars that held the sample were written again (the rows of the other shards are the same)
        for folder, name in (("balanced", f"{holder:05d}.tar"), ("precached", f"{holder:05d}.tar")):
            changed = sorted(p.name for p in after if p.parent.name == folder and p.suffix == ".tar"
                             and before.get(p) != after[p])
            assert changed == [name], (folder, changed)
