"""Shared fixtures: a real HTTP image server on 127.0.0.1, a tiny CLIP on disk, real Dagster instances."""

import os
from pathlib import Path

import pytest

for _var, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_var, _value)

CHECKOUT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> str:
    from shardprep.tiny_models import build_tiny_clip

    return build_tiny_clip(str(tmp_path_factory.mktemp("tiny-clip")))


@pytest.fixture(scope="session")
def image_site(tmp_path_factory):
    """Demo-like images (with broken ones) served over HTTP on 127.0.0.1; yields (dir, base_url)."""
    from shardprep import synthetic

    site = tmp_path_factory.mktemp("site")
    synthetic.make_demo_site(str(site), n_images=120, seed=1)
    base_url, stop = synthetic.serve_directory(str(site))
    yield str(site), base_url
    stop()


def write_config(path: Path, **fields) -> str:
    import yaml

    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return str(path)


@pytest.fixture(scope="session")
def tiny_nemo_dirs(tmp_path_factory) -> dict:
    from shardprep.nemo_models import build_tiny_nemo_models

    return build_tiny_nemo_models(str(tmp_path_factory.mktemp("tiny-nemo")))


def nemo_config(dirs: dict) -> dict:
    """Config fields pointing the NeMo outputs at tiny local models, at small resolutions."""
    return {"sd_autoencoder": dirs["sd_autoencoder"], "sd_clip_text_model": dirs["clip"],
            "diffusion_t5_model": dirs["t5"], "diffusion_autoencoder": dirs["autoencoder"],
            "precache_resolution": 32, "diffusion_resolution": 32, "nemo_batch_size": 8,
            "energon_split_ratio": [0.7, 0.3, 0.0]}
