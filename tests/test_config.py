import pytest

from shardprep.config import ConfigError, config_from_dict, load_config

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


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("source: src/*.parquet\noutput_root: out\n")
    c = load_config(str(p))
    assert c.source == str(tmp_path / "src" / "*.parquet")
    assert c.output_root == str(tmp_path / "out")
