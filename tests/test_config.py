import math

import pytest
import yaml

from shardprep.config import ConfigError, DatasetConfig, config_from_dict, load_config
from shardprep.errors import ShardprepError

BASE = {"source": "/data/src/*.parquet", "output_root": "/data/out"}


def test_defaults_are_img2datasets():
    c = config_from_dict(BASE)
    assert (c.samples_per_shard, c.image_size, c.resize_mode, c.encode_format, c.encode_quality) == (
        10_000, 256, "border", "jpg", 95)
    assert c.allow_private_addresses is False
    assert c.oom_sample == 4


@pytest.mark.parametrize(
    "override, field",
    [
        ({"resize_mode": "stretch"}, "resize_mode"),
        ({"encode_format": "gif"}, "encode_format"),
        ({"encode_format": "png", "encode_quality": 95}, "encode_quality"),
        ({"encode_format": "png"}, "encode_quality"),  # the default 95 is out of png's [0, 9]
        ({"samples_per_shard": 0}, "samples_per_shard"),
        ({"image_size": "big"}, "image_size"),
        ({"device": "tpu"}, "device"),
        ({"allow_private_addresses": "yes"}, "allow_private_addresses"),
        ({"timeout": -1}, "timeout"),
        ({"save_additional_columns": ["key"]}, "save_additional_columns"),
    ],
)
def test_bad_field_is_named(override, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        config_from_dict({**BASE, **override})


_NOT_TEXT = ["", "  ", 5, None, ["a"]]
_NOT_FLAG = ["no", "yes", "true", 0, 1, None]
_NOT_POSITIVE = [0, -1, "8", True, 8.0, None]
_NOT_COUNT = [-1, "1", True, 1.5]  # for fields where 0 is fine
# at least one wrong value for every field of DatasetConfig (test_every_field_has_bad_values keeps it so)
BAD_VALUES = {
    "source": ["", "  ", 5, ["a"]],  # null is allowed with a video_source (test_ledger)
    "output_root": _NOT_TEXT,
    "url_col": _NOT_TEXT,
    "caption_col": ["", "  ", 3, ["caption"]],
    "save_additional_columns": [["key"], ["url", "a"], ["a", "a"], [""], [1], "source_id", {"a": 1}],
    "takedown_lists": [[""], [1], "optout.txt", {"a": 1}],
    "disallowed_header_directives": [[""], [1], "noai", {"a": 1}],
    "samples_per_shard": _NOT_POSITIVE,
    "oom_shard_count": _NOT_POSITIVE,
    "shards_per_partition": _NOT_POSITIVE,
    "image_size": _NOT_POSITIVE,
    "resize_mode": ["stretch", "Border", "", None, 1],
    "resize_only_if_bigger": _NOT_FLAG,
    "encode_format": ["gif", "jpeg", "JPG", None],
    "encode_quality": [-1, 101, "95", True, 95.0],
    "extract_exif": _NOT_FLAG,
    "fast_decode": _NOT_FLAG,
    "decode_threads": _NOT_COUNT,
    "timeout": [0, -1, "5", True, math.nan, math.inf, None],
    "retries": _NOT_COUNT,
    "thread_count": _NOT_POSITIVE,
    "max_image_bytes": _NOT_POSITIVE,
    "max_image_pixels": _NOT_POSITIVE,
    "allow_private_addresses": _NOT_FLAG,
    "user_agent": _NOT_TEXT,
    "respect_robots_txt": _NOT_FLAG,
    "per_host_connections": _NOT_COUNT + [None],
    "per_host_requests_per_second": [-1, -0.5, "5", True, math.nan, math.inf, None],
    "per_host_state_dir": ["", "  ", 5, ["a"]],
    "per_host_limits_url": ["", "  ", "127.0.0.1:6379", "http://127.0.0.1:6379", "redis://", 6379, ["redis://a"]],
    "video_source": ["", "  ", 5, ["a"]],
    "video_url_col": _NOT_TEXT,
    "video_caption_col": ["", "  ", 3, ["name"]],
    "video_autoencoder": _NOT_TEXT,
    "video_diffusion_frames": _NOT_POSITIVE,
    "video_diffusion_resolution": [0, -16, 30, "32", True, 32.0, None],
    "video_size": [0, -1, "8", True, 8.0],
    "video_resize_mode": ["crop,scale", "border", "scale,", "", None, 1],
    "video_frame_rate": [0, -1, 241, "8", True, math.nan, math.inf],
    "video_max_duration": [0, -1, "5", True, math.nan, math.inf],
    "video_clip_length": [0, -1, "5", True, math.nan, math.inf],
    "video_min_clip_length": [-1, "0", True, math.nan, None],
    "video_clip_strategy": ["last", "First", "", None],
    "video_clip_col": ["", "  ", 3, ["clips"]],
    "video_encode_format": ["mkv", "MP4", "", None],
    "video_crf": [-1, 52, "23", True, 23.0],
    "video_preset": ["placebo", "Fast", "", None],
    "video_thread_count": _NOT_POSITIVE,
    "video_decode_threads": _NOT_COUNT,
    "max_video_bytes": _NOT_POSITIVE,
    "max_video_pixels": _NOT_POSITIVE,
    "video_timeout": [0, -1, "5", True, math.nan, math.inf, None],
    "clip_model": _NOT_TEXT,
    "device": ["tpu", "gpu", "cuda:", "cuda:x", "cuda0", "CPU", "", 0, None],
    "batch_size": _NOT_POSITIVE,
    "enable_text": _NOT_FLAG,
    "enable_nemo_text2img": _NOT_FLAG,
    "tar_chunk_size": ["big", *_NOT_POSITIVE],
    "precache_resolution": [0, -8, 30, 500, "512", True, 512.0],
    "precache_keep_original": _NOT_FLAG,
    "sd_autoencoder": _NOT_TEXT,
    "aesthetic_model": ["", "  ", 3, ["a.pth"]],  # a file that does not fit: tests/test_scores.py
    "nsfw_model": ["", "  ", 3, ["a.pth"]],
    "watermark_model": ["", "  ", 3, ["a.pth"]],
    "captioner": ["", "  ", 3, ["Salesforce/blip-image-captioning-base"]],
    "caption_prompt": ["", "  ", 3, ["a photograph of"]],
    "caption_max_new_tokens": _NOT_POSITIVE,
    "caption_batch_size": _NOT_POSITIVE,
    "caption_video_frames": _NOT_POSITIVE,
    "train_caption": ["mixed", "", 1, None, ["synthetic"]],
    "dedup": _NOT_FLAG,
    "dedup_threshold": [0, -0.5, 1.5, "0.9", True, float("nan")],
    "aesthetic_min": ["5", True, float("inf"), [5]],
    "nsfw_max": [-0.1, 1.5, "0.5", True],
    "watermark_max": [-0.1, 1.5, "0.5", True, float("nan")],
    "min_original_size": [0, -1, 512.0, "512", True],
    "caption_min_length": [-1, 2.5, "3", True],
    "caption_max_length": [0, -1, 2.5, "3", True],
    "sd_clip_text_model": _NOT_TEXT,
    "enable_nemo_diffusion": _NOT_FLAG,
    "diffusion_t5_model": _NOT_TEXT,
    "diffusion_autoencoder": _NOT_TEXT,
    "diffusion_resolution": [0, -16, 30, 520, "512", True, 512.0],
    "nemo_batch_size": _NOT_POSITIVE,
    "storage_options": ["s3", [1], {"s3": "x"}, {"nosuch": {}}, {"s3": {"endpoint": "http://127.0.0.1:8333"}},
                        {"s3": {"endpoint_url": "127.0.0.1:8333"}}],
    "energon_split_ratio": [[0, 0, 0], [1, -1, 0], [0.9, 0.1], [0.8, 0.1, 0.1, 0.0], [1, "0", 0],
                            [1, True, 0], [math.nan, 1, 0], [math.inf, 1, 0], "0.9,0.1,0", 1, None],
}


@pytest.mark.parametrize("field, value", [(f, v) for f, values in BAD_VALUES.items() for v in values])
def test_every_bad_value_is_refused_naming_field_and_value(field, value):
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, field: value}, origin="config.yaml")
    message = str(err.value)
    assert message.startswith(f"config.yaml: config field '{field}': got {value!r} ({type(value).__name__}); allowed: ")
    assert "\n" not in message  # one wrong field, one line
    with pytest.raises(ConfigError, match=f"'{field}'"):  # the constructor validates the same way
        DatasetConfig(**{**BASE, field: value})


def test_every_field_has_bad_values():
    assert set(BAD_VALUES) == set(DatasetConfig.model_fields), "add wrong values for new fields to BAD_VALUES"
    assert all(BAD_VALUES.values())


def test_the_reported_example_is_exact():
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "enable_nemo_diffusion": "no"}, origin="config.yaml")
    assert str(err.value) == "config.yaml: config field 'enable_nemo_diffusion': got 'no' (str); allowed: true or false"
    assert isinstance(err.value, ShardprepError) and isinstance(err.value, ValueError)


def test_good_edge_values_load():
    c = config_from_dict({**BASE, "caption_col": None, "save_additional_columns": None, "timeout": 3,
                          "device": "cuda:1", "decode_threads": 0, "retries": 0, "encode_format": "png",
                          "encode_quality": 9, "precache_resolution": 8, "diffusion_resolution": 16,
                          "energon_split_ratio": [0, 0, 1]})
    assert c.caption_col is None and c.save_additional_columns == ()
    assert c.timeout == 3.0 and c.energon_split_ratio == (0.0, 0.0, 1.0)
    with pytest.raises(AttributeError):
        c.image_size = 64  # frozen


def test_several_wrong_fields_are_all_reported():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"source": "a", "tar_chunk_size": "big", "diffusion_resolution": 30,
                          "enable_nemo_diffusion": "no", "image_sise": 64}, origin="c.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 5 and all(line.startswith("c.yaml: ") for line in lines)
    for expected in ("unknown config field(s) ['image_sise']", "config field 'output_root' is required",
                     "config field 'tar_chunk_size': got 'big' (str)",
                     "config field 'diffusion_resolution': got 30 (int); allowed: a positive multiple of 16",
                     "config field 'enable_nemo_diffusion': got 'no' (str)"):
        assert any(expected in line for line in lines), expected


def test_unknown_field_suggests_the_close_name():
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "samples_per_shrad": 10, "zzz": 1})
    message = str(err.value)
    assert "did you mean 'samples_per_shard' instead of 'samples_per_shrad'?" in message
    assert "'zzz'" in message and "known fields:" in message and "'output_root'" in message
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['1'\]"):
        config_from_dict({**BASE, 1: "x"})  # YAML allows non-string keys


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="must be a mapping"):
        config_from_dict(["source", "a"])


def test_to_dict_round_trips():
    c = config_from_dict({**BASE, "save_additional_columns": ["source_id", "score"], "caption_col": None,
                          "energon_split_ratio": [0.7, 0.3, 0], "timeout": 5})
    d = c.to_dict()
    assert d["save_additional_columns"] == ["source_id", "score"] and d["energon_split_ratio"] == [0.7, 0.3, 0.0]
    assert config_from_dict(d) == c
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(d))) == c  # and through YAML


def test_demo_config_loads(tmp_path):
    # the fields demo/run_demo.py writes (its model paths are folders it builds)
    models = tmp_path / "models"
    demo = {"source": "source/*.parquet", "output_root": "out", "url_col": "url", "caption_col": "caption",
            "save_additional_columns": ["source_id"], "samples_per_shard": 20, "image_size": 64,
            "resize_mode": "center_crop", "encode_format": "jpg", "encode_quality": 90, "timeout": 5,
            "thread_count": 16, "allow_private_addresses": True, "clip_model": f"hf_clip:{models / 'clip'}",
            "device": "auto", "batch_size": 64, "tar_chunk_size": 100, "precache_resolution": 64,
            "diffusion_resolution": 64, "nemo_batch_size": 16, "sd_autoencoder": str(models / "sd_vae"),
            "sd_clip_text_model": str(models / "clip"), "diffusion_t5_model": str(models / "t5"),
            "diffusion_autoencoder": str(models / "vae"), "energon_split_ratio": [0.8, 0.2, 0.0]}
    p = tmp_path / "shardprep.yaml"
    p.write_text(yaml.safe_dump(demo, sort_keys=False))
    c = load_config(str(p))
    assert c.output_root == str(tmp_path / "out") and c.save_additional_columns == ("source_id",)
    assert c.energon_split_ratio == (0.8, 0.2, 0.0) and c.oom_sample == 2


def test_missing_and_unknown_fields(tmp_path):
    with pytest.raises(ConfigError, match="'output_root' is required"):
        config_from_dict({"source": "x"})
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['image_sise'\]"):
        config_from_dict({**BASE, "image_sise": 64})
    p = tmp_path / "bad.yaml"
    p.write_text("source: a\noutput_root: b\nresize_mode: squash\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*'resize_mode'"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))


def test_quoted_no_is_not_false(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text('source: a\noutput_root: b\nenable_nemo_diffusion: "no"\n')
    with pytest.raises(ConfigError, match=r"c.yaml: config field 'enable_nemo_diffusion': got 'no' \(str\)"):
        load_config(str(p))
    p.write_text("source: a\noutput_root: b\nenable_nemo_diffusion: no\n")  # YAML 1.1's unquoted no is false
    assert load_config(str(p)).enable_nemo_diffusion is False


def test_output_root_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("not a folder")
    p = tmp_path / "c.yaml"
    p.write_text("source: src/*.parquet\noutput_root: out\n")
    with pytest.raises(ConfigError, match=r"c.yaml: config field 'output_root': got '.*out', an existing file"):
        load_config(str(p))
    (tmp_path / "out").unlink()
    (tmp_path / "out").mkdir()
    assert load_config(str(p)).output_root == str(tmp_path / "out")


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("source: src/*.parquet\noutput_root: out\n")
    c = load_config(str(p))
    assert c.source == str(tmp_path / "src" / "*.parquet")
    assert c.output_root == str(tmp_path / "out")
