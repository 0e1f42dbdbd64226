"""Shared fixtures: a real HTTP image server on 127.0.0.1, tiny models on disk."""

import os
import signal

import pytest

for _var, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_var, _value)


# A non-interactive shell starts a background command (`make test &`, `nohup ... &`) with SIGINT ignored,
# and an ignored signal stays ignored in every process started from it: the two tests that stop a shard
# with SIGINT (test_download_abort.py) then failed, the suite launched that way (2026-12-06). Python's own
# handler, unlike SIG_IGN, is reset at exec, so this process and its children see SIGINT as users do.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The test files that take longest, longest first (about 115, 105, 102, 99, 99, 95, 65, 56, ... seconds a
# file on the 2-core machine, 2026-11-28). `make test` hands whole files to its two workers in collection
# order (`--dist loadfile --no-loadscope-reorder`), so these start first and the short files fill in at the
# end. xdist's own order (most tests first) left the one-test files, the Celery and SIGTERM tests among
# them, for last: the suite stood at 93% for its last ~5 minutes (14.3 min in all; this order: 13.4).
SLOW_FIRST = ("test_global_phase_crash", "test_live_ui", "test_parallel", "test_crash_resume", "test_distributed",
              "test_pipeline", "test_blocks", "test_cancel", "test_training_text", "test_video_pipeline", "test_s3",
              "test_embeddings", "test_postgres", "test_watermark", "test_dataloaders", "test_report_cli",
              "test_concurrency_wait", "test_pixels", "test_run_truth", "test_verify", "test_source_changes",
              "test_versions", "test_captions", "test_takedown", "test_object_storage")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's tests stay together, in order


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
