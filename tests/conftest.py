"""Shared fixtures: a real HTTP image server on 127.0.0.1, tiny models on disk."""

import os

import pytest

for _var, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_var, _value)


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> str:
    from tests.fixtures.tiny_clip import build_tiny_clip

    return build_tiny_clip(str(tmp_path_factory.mktemp("tiny-clip")))


@pytest.fixture(scope="session")
def image_site(tmp_path_factory):
    """Demo-like images (with broken ones) served over HTTP on 127.0.0.1; yields (dir, base_url)."""
    from tests.fixtures import synthetic
    from tests.fixtures.http_server import serve_directory

    site = tmp_path_factory.mktemp("site")
    synthetic.make_demo_site(str(site), n_images=120, seed=1)
    base_url, stop = serve_directory(str(site))
    yield str(site), base_url
    stop()


@pytest.fixture(scope="session")
def tiny_nemo_dirs(tmp_path_factory) -> dict:
    from tests.fixtures.tiny_nemo import build_tiny_nemo_models

    return build_tiny_nemo_models(str(tmp_path_factory.mktemp("tiny-nemo")))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (seaweedfs ``weed mini``) on free ports of 127.0.0.1, with credentials and one
    bucket; one per test process (pytest-xdist workers each start their own)."""
    from tests.fixtures import seaweed

    server = seaweed.start(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    seaweed.stop(server)


@pytest.fixture
def scripted_server():
    """A ScriptedServer on 127.0.0.1 (tests/fixtures/scripted_http.py), with the process's robots.txt
    policies forgotten before and after: they are kept by authority, and a port another test's server had
    must carry nothing over."""
    from shardprep import robots
    from tests.fixtures.scripted_http import ScriptedServer

    robots.forget_all()
    server = ScriptedServer()
    yield server
    server.stop()
    robots.forget_all()
