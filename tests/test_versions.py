"""Config changes are seen: an asset whose output a changed field alters is redone (and exactly those
(asset, shard) pairs), a field that changes only speed redoes nothing, a disabled asset never claims to
be materialized."""

import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from shardprep.artifacts import ARTIFACTS
from shardprep.config import config_from_dict
from shardprep.layout import Layout
from shardprep.versions import artifact_versions, stamped_version
from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import nemo_config, write_config

BASE = {"source": "/data/*.parquet", "output_root": "/data/out"}


def changed(**fields) -> set[str]:
    before, after = artifact_versions(config_from_dict(BASE)), artifact_versions(config_from_dict({**BASE, **fields}))
    return {a for a in ARTIFACTS if before[a] != after[a]}


def test_versions_follow_the_fields_each_artifact_reads():
    downstream_of_images = {"image_shards", "clip_embeddings", "reordered_embeddings", "image_scores", "captions",
                            "training_text", "duplicates",
                            "sample_selection", "diffusion_samples",
                            "balanced_shards", "wdinfo", "precached_encodings", "image_energon_index",
                            "diffusion_energon_index", "dataset_report"}
    assert changed(image_size=128) == downstream_of_images
    assert changed(clip_model="open_clip:ViT-B-32/laion2b_s34b_b79k") == {
        "clip_embeddings", "reordered_embeddings", "image_scores", "training_text", "duplicates", "dataset_report"}
    assert changed(diffusion_resolution=256) == {"diffusion_samples", "diffusion_energon_index"}
    # synthetic captions: only the captions (and training_text, which is off: train_caption is original)
    assert changed(captioner="Salesforce/blip-image-captioning-base") == {"captions", "training_text"}
    assert changed(caption_prompt="a photograph of") == changed(caption_max_new_tokens=10) == {"captions"}
    assert changed(caption_video_frames=8) == {"captions"}
    # training on them: what holds the text, never a download, an embedding of the images or a latent's input
    captioned = {**BASE, "captioner": "Salesforce/blip-image-captioning-base"}
    text = {"training_text", "diffusion_samples", "diffusion_energon_index", "balanced_shards", "wdinfo",
            "precached_encodings", "image_energon_index"}
    for mode in ("synthetic", "both"):
        before = artifact_versions(config_from_dict(captioned))
        after = artifact_versions(config_from_dict({**captioned, "train_caption": mode}))
        assert {a for a in ARTIFACTS if before[a] != after[a]} == text, mode
    synthetic, both = (artifact_versions(config_from_dict({**captioned, "train_caption": m})) for m in ("synthetic", "both"))
    assert {a for a in ARTIFACTS if synthetic[a] != both[a]} == text
    # with synthetic captions in the training text, a caption setting reaches it
    before = artifact_versions(config_from_dict({**captioned, "train_caption": "both"}))
    after = artifact_versions(config_from_dict({**captioned, "train_caption": "both", "caption_max_new_tokens": 9}))
    assert {a for a in ARTIFACTS if before[a] != after[a]} == text | {"captions"}
    # a video setting makes only what is made from videos stale, never an image output
    assert changed(video_size=360) == {"video_shards", "video_diffusion_samples", "diffusion_energon_index",
                                       "dataset_report"}
    assert changed(video_diffusion_frames=17) == {"video_diffusion_samples", "diffusion_energon_index"}
    # captions are made from both media (one version): they follow the video settings in a dataset with videos
    videos = {**BASE, "video_source": "/data/videos/*.parquet"}
    before = artifact_versions(config_from_dict(videos))
    after = artifact_versions(config_from_dict({**videos, "video_size": 360}))
    assert {a for a in ARTIFACTS if before[a] != after[a]} == {"video_shards", "video_diffusion_samples",
                                                                "diffusion_energon_index", "dataset_report", "captions"}
    assert changed(tar_chunk_size=500) == {"balanced_shards", "wdinfo", "precached_encodings"}
    assert changed(energon_split_ratio=[0.8, 0.2, 0.0]) == {"image_energon_index", "diffusion_energon_index"}
    # a curation rule: the selection and the outputs made from it, never downloads, embeddings or latents
    selected = {"sample_selection", "balanced_shards", "wdinfo", "precached_encodings", "image_energon_index",
                "diffusion_energon_index", "dataset_report"}
    assert changed(min_original_size=512) == selected
    assert changed(caption_max_length=300) == selected
    assert changed(dedup=True) == selected | {"duplicates"}
    # how fast, not what: nothing is stale
    for speed in ({"thread_count": 8}, {"batch_size": 16}, {"timeout": 3}, {"decode_threads": 1},
                  {"device": "cpu"}, {"nemo_batch_size": 2}, {"retries": 2}, {"caption_batch_size": 4}):
        assert changed(**speed) == set(), speed
    # every config field is either read by an artifact or known to change no output
    read = {f for record in ARTIFACTS.values() for f in record.fields}
    speed_only = {"source", "output_root", "storage_options", "samples_per_shard", "oom_shard_count",
                  "shards_per_partition", "timeout",
                  "retries", "thread_count", "decode_threads", "allow_private_addresses", "user_agent", "device",
                  "respect_robots_txt", "disallowed_header_directives",  # which URLs are fetched, like the address guard: shards kept are not redone
                  # how fast a host is asked, not what a shard holds
                  "per_host_connections", "per_host_requests_per_second", "per_host_state_dir", "per_host_limits_url",
                  "batch_size", "nemo_batch_size", "caption_batch_size", "enable_nemo_text2img", "enable_nemo_diffusion", "video_source",
                  "video_thread_count", "video_decode_threads", "video_timeout"}
    assert read | speed_only == set(config_from_dict(BASE).to_dict()), "classify the new config field"


def test_diffusion_samples_read_the_embeddings_only_through_an_aesthetic_head(tmp_path):
    """Their json's aesthetic_score is image_scores': with an aesthetic head, a new head or new embeddings
    make them stale; an NSFW head never does, and without an aesthetic head the embeddings do not."""
    import torch

    from tests.fixtures.score_heads import NsfwL14

    torch.save(torch.nn.Linear(512, 1).state_dict(), tmp_path / "sa_0_4_vit_b_32_linear.pth")
    torch.save(torch.nn.Linear(512, 1).state_dict(), tmp_path / "other_linear.pth")
    torch.save(NsfwL14(dim=512).state_dict(), tmp_path / "nsfw.pth")
    scored = {**BASE, "aesthetic_model": str(tmp_path / "sa_0_4_vit_b_32_linear.pth")}

    def stale(before: dict, **fields) -> set[str]:
        a, b = artifact_versions(config_from_dict(before)), artifact_versions(config_from_dict({**before, **fields}))
        return {k for k in ARTIFACTS if a[k] != b[k]}

    assert stale(scored, aesthetic_model=str(tmp_path / "other_linear.pth")) == {
        "image_scores", "diffusion_samples", "diffusion_energon_index", "dataset_report"}
    assert stale(scored, nsfw_model=str(tmp_path / "nsfw.pth")) == {"image_scores", "dataset_report"}
    assert {"diffusion_samples", "image_scores"} <= stale(scored, clip_model="ViT-B/16")
    assert "diffusion_samples" not in stale(BASE, clip_model="ViT-B/16")
    # the watermark detector: the scores, never the diffusion samples; its rule, the selection and what reads it
    (tmp_path / "watermark_model_v1.pt").write_bytes(b"")  # config load checks only that the file is there
    watermark = str(tmp_path / "watermark_model_v1.pt")
    assert stale(scored, watermark_model=watermark) == {"image_scores", "dataset_report"}
    assert stale({**scored, "watermark_model": watermark}, watermark_max=0.5) == {
        "sample_selection", "balanced_shards", "wdinfo", "precached_encodings", "image_energon_index",
        "diffusion_energon_index", "dataset_report"}


def _materializations(instance: dg.DagsterInstance) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in instance.get_asset_keys():
        records = instance.fetch_materializations(key, limit=1000).records
        counts[key.to_user_string()] = len(records)
    return counts


def _redone(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {a: n - before.get(a, 0) for a, n in after.items() if n != before.get(a, 0)}


@pytest.fixture
def dataset(tmp_path, image_site, tiny_clip_dir, tiny_nemo_dirs):
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=[30], n_images=120, seed=4)
    fields = dict(source=f"{src}/*.parquet", output_root=str(tmp_path / "out"), samples_per_shard=15,
                  image_size=32, resize_mode="center_crop", allow_private_addresses=True,
                  clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, thread_count=8, timeout=5,
                  tar_chunk_size=5, enable_nemo_diffusion=False, **nemo_config(tiny_nemo_dirs))
    return tmp_path / "shardprep.yaml", fields


def test_config_changes_redo_exactly_what_they_change(dataset):
    path, fields = dataset
    layout = Layout(fields["output_root"])
    with dg.instance_for_test() as instance:
        # diffusion disabled: not in the graph, no folder, never reported as materialized
        first = run_pipeline(write_config(path, **fields), instance=instance, progress=False, in_process=True)
        assert first.ok, first.failed
        assert "diffusion_samples" not in first.materialized and "diffusion_energon_index" not in first.materialized
        assert not Path(layout.diffusion_dir).exists()
        assert dg.AssetKey("diffusion_samples") not in instance.get_asset_keys()

        # enabled: exactly the diffusion assets run, for every shard
        before = _materializations(instance)
        second = run_pipeline(write_config(path, **{**fields, "enable_nemo_diffusion": True}), instance=instance, in_process=True,
                              progress=False)
        assert second.ok, second.failed
        assert second.materialized["diffusion_samples"] == 2 and second.materialized["diffusion_energon_index"] == 1
        assert sorted(p.name for p in Path(layout.diffusion_dir).glob("*.tar")) == ["00000.tar", "00001.tar"]
        redone = _redone(before, _materializations(instance))
        # video_diffusion_samples: enabled too, materialized as not applicable (no video shard)
        assert set(redone) == {"diffusion_samples", "video_diffusion_samples", "diffusion_energon_index", "takedowns",
                               "duplicates", "sample_selection", "balanced_shards", "wdinfo",
                               "precached_encodings", "image_energon_index", "dataset_report"}
        assert redone["diffusion_samples"] == 2
        # (the global run re-evaluates every unpartitioned asset; they are incremental and do no work)

        # a speed-only field: nothing to do
        fields = {**fields, "enable_nemo_diffusion": True}
        third = run_pipeline(write_config(path, **{**fields, "thread_count": 4, "nemo_batch_size": 3}),
                             instance=instance, progress=False, in_process=True)
        assert third.ok and third.runs == 0

        # the diffusion resolution: only the diffusion samples (and their index) are redone
        old_tar = Path(layout.diffusion_tar("00000")).read_bytes()
        before = _materializations(instance)
        fourth = run_pipeline(write_config(path, **{**fields, "diffusion_resolution": 48}), instance=instance, in_process=True,
                              progress=False)
        assert fourth.ok, fourth.failed
        redone = _redone(before, _materializations(instance))
        assert redone.get("diffusion_samples") == 2
        assert not {"source_parquet", "image_shards", "clip_embeddings", "reordered_embeddings"} & set(redone)
        assert Path(layout.diffusion_tar("00000")).read_bytes() != old_tar
        version = artifact_versions(config_from_dict(yaml.safe_load(Path(path).read_text())))["diffusion_samples"]
        assert stamped_version(layout, "diffusion_samples", "00000") == version


def test_outdated_partitions_show_in_status(dataset):
    from shardprep_dagster.orchestration.status import asset_statuses, format_status

    path, fields = dataset
    with dg.instance_for_test() as instance:
        assert run_pipeline(write_config(path, **fields), instance=instance, progress=False, in_process=True).ok
        write_config(path, **{**fields, "clip_model": fields["clip_model"] + "/"})  # same model, new spelling
        statuses = {s.asset: s for s in asset_statuses(str(path))}
        assert statuses["clip_embeddings"].outdated == 2 and statuses["clip_embeddings"].materialized == 0
        assert statuses["image_shards"].outdated == 0 and statuses["image_shards"].materialized == 2
        assert statuses["dataset_report"].state == "outdated"
        assert "outdated" in format_status(list(statuses.values())).splitlines()[0]
    # the same from a fresh process, as `shardprep status` runs it: counted in Arrow without importing pandas
    # (pa.array of a list or a Python scalar in a compute call would import it: ~0.2 of its ~0.4 CPU-s)
    code = ("import sys\nfrom shardprep_dagster.orchestration.status import asset_statuses\n"
            "s = {x.asset: x for x in asset_statuses(sys.argv[1])}\n"
            "print(s['clip_embeddings'].outdated, s['image_shards'].materialized, 'pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2", "False"]
