"""A failed blocking check stops downstream work in the run and says why."""

import io
import tarfile
from pathlib import Path

import dagster as dg
import numpy as np

from shardprep.checks import check_clip_embeddings, check_image_shard, check_reordered_embeddings
from shardprep.layout import Layout
from shardprep_dagster.definitions import build_defs
from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config


def _drop_first_sample(tar_path: str) -> str:
    with tarfile.open(tar_path) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    first = members[0][0].name.split(".")[0]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as out:
        for m, data in members:
            if m.name.split(".")[0] != first:
                out.addfile(m, io.BytesIO(data))
    Path(tar_path).write_bytes(buf.getvalue())
    return first


def _one_shard(tmp_path, image_site, tiny_clip_dir, broken_share: float, seed: int = 0):
    """A one-shard dataset (20 rows) with the NeMo outputs off; returns (config path, layout)."""
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=20, n_images=120,
                                   broken_share=broken_share, seed=seed)
    config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(tmp_path / "out"),
                          samples_per_shard=20, image_size=32, allow_private_addresses=True,
                          clip_model=f"hf_clip:{tiny_clip_dir}", enable_nemo_text2img=False,
                          enable_nemo_diffusion=False)
    return config, Layout(str(tmp_path / "out"))


def test_failed_check_blocks_downstream(tmp_path, image_site, tiny_clip_dir):
    config, layout = _one_shard(tmp_path, image_site, tiny_clip_dir, broken_share=0.0)
    home = tmp_path / "home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
        assert check_image_shard(layout, "00000").passed
        assert check_clip_embeddings(layout, "00000").passed
        assert check_reordered_embeddings(layout, "00000", rows=20, index_width=2).passed

        lost = _drop_first_sample(layout.tar("00000"))  # the tar no longer matches the parquet
        for path in (layout.img_emb("00000"), layout.text_emb("00000"), layout.emb_metadata("00000")):
            Path(path).unlink()
        job = build_defs(config).resolve_job_def("shards_job")
        result = job.execute_in_process(
            partition_key="00000", instance=instance, raise_on_error=False,
            asset_selection=[dg.AssetKey("image_shards"), dg.AssetKey("clip_embeddings")])

    (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "tar_matches_parquet"]
    assert not evaluation.passed and evaluation.partition == "00000"
    assert "19 samples, the parquet has 20 successes" in evaluation.description and lost in evaluation.description
    assert result.asset_materializations_for_node("clip_embeddings") == []  # blocked, never ran
    assert not Path(layout.img_emb("00000")).exists()


def test_checks_catch_misplaced_and_nonfinite_rows(tmp_path, image_site, tiny_clip_dir):
    config, layout = _one_shard(tmp_path, image_site, tiny_clip_dir, broken_share=0.2, seed=4)
    home = tmp_path / "home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        assert run_pipeline(config, instance=instance, progress=False, in_process=True).ok
    reordered = np.load(layout.reordered_img("00000"))
    np.save(layout.reordered_img("00000"), np.roll(reordered, 1, axis=0))
    outcome = check_reordered_embeddings(layout, "00000", rows=20, index_width=2)
    assert not outcome.passed and outcome.metadata["misplaced_rows"] > 0
    emb = np.load(layout.img_emb("00000"))
    emb[0, 0] = np.nan
    np.save(layout.img_emb("00000"), emb)
    outcome = check_clip_embeddings(layout, "00000")
    assert not outcome.passed and "NaN/Inf" in outcome.description
