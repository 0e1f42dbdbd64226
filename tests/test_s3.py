"""The whole pipeline on a real S3 server (seaweedfs ``weed mini``, tests/fixtures/seaweed.py, with
authentication on): source parquet and output root on ``s3://``, the endpoint and credentials from the
standard AWS variables only (or the config's ``storage_options``), every asset, check, index and the
report; then the outputs read back FROM S3 by the upstream loaders our users train with:

- webdataset: a real ``wds.WebDataset`` pipeline over presigned HTTP URLs of the S3 tars (webdataset's
  own http handler, i.e. curl; no shardprep code in the read path);
- DALLE2-pytorch's decoder loader (its module loaded by file path): the same presigned tar URLs, its
  embedding folders as ``s3://`` URLs (it lists and reads them through fsspec/s3fs);
- embedding-reader: ``EmbeddingReader("s3://...")`` (fsspec/s3fs);
- megatron-energon 7.4.1: ``get_train_dataset("msc://PROFILE/...")``, a multi-storage-client profile of
  type s3 (boto3) whose endpoint and credentials come from the same AWS variables;
- shardprep's own loader with ``s3://`` URLs.
"""

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import uuid

import dagster as dg
import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from shardprep import storage
from shardprep.keys import index_of_key
from shardprep.layout import Layout
from shardprep_dagster.orchestration.runner import run_pipeline
from tests.fixtures import synthetic
from tests.fixtures.configs import CHECKOUT, nemo_config, write_config
from tests.fixtures.energon_read import energon_keys
from tests.fixtures.s3_readback import write_msc_profile

# DALLE2 pins pin_memory=True and energon's loader asks for it; on a CPU-only machine torch warns
pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")


@pytest.fixture(scope="module")
def s3_env(s3_server):
    """Only the test server's AWS variables in this process (every fsspec/boto client reads them)."""
    mp = pytest.MonkeyPatch()
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        mp.delenv(k)
    for k, v in s3_server.env().items():
        mp.setenv(k, v)
    yield s3_server
    mp.undo()


def _upload_sources(fs, folder, root: str, base_url: str, rows: list[int], seed: int) -> None:
    for path in synthetic.make_source_parquets(str(folder), base_url, n_files=len(rows), rows_per_file=rows,
                                               n_images=120, seed=seed):
        fs.put_file(path, f"{root}/source/{os.path.basename(path)}")


@pytest.fixture(scope="module")
def s3_run(s3_env, tmp_path_factory, image_site, tiny_clip_dir, tiny_nemo_dirs):
    """Every asset run twice in this process on an S3 source and output root."""
    server = s3_env
    fs = server.filesystem()
    tmp = tmp_path_factory.mktemp("s3-pipeline")
    root = f"s3://{server.bucket}/pipeline-{uuid.uuid4().hex[:8]}"
    _upload_sources(fs, tmp / "src", root, image_site[1], [30, 12], seed=12)
    config = write_config(tmp / "c.yaml", source=f"{root}/source/*.parquet", output_root=f"{root}/out",
                          samples_per_shard=15, image_size=32, resize_mode="center_crop",
                          allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16,
                          thread_count=8, timeout=5, tar_chunk_size=10, **nemo_config(tiny_nemo_dirs))
    cwd = os.getcwd()
    with dg.instance_for_test() as instance:
        os.chdir(tmp)  # an "s3:" folder would appear here if a URL were used as a local path
        try:
            summary = run_pipeline(config, instance=instance, progress=False, in_process=True)
            again = run_pipeline(config, instance=instance, progress=False, in_process=True)
        finally:
            os.chdir(cwd)
        layout = Layout(f"{root}/out")
        keys = {}
        for shard in summary.shards:
            with fs.open(layout.shard_parquet(shard), "rb") as f:
                table = pq.read_table(f).to_pandas()
            keys[shard] = sorted(table[table.status == "success"]["key"])
        yield dict(fs=fs, server=server, root=root, layout=layout, summary=summary, again=again, tmp=tmp,
                   keys=keys, config=config, instance=instance)


def _presigned(fs, urls: list[str]) -> list[str]:
    # plain HTTP URLs any client can GET for an hour: what webdataset's curl handler reads
    return [fs.url(u, expires=3600) for u in urls]


def _npy(fs, url: str) -> np.ndarray:
    with fs.open(url, "rb") as f:
        return np.load(f)


def test_every_asset_runs_on_s3_and_a_rerun_does_nothing(s3_run):
    summary, again, layout, fs = s3_run["summary"], s3_run["again"], s3_run["layout"], s3_run["fs"]
    assert summary.ok, summary.failed
    assert summary.shards == ["00000", "00001", "00002"]
    assert all(n == 3 for a, n in summary.materialized.items() if a not in summary.global_assets)
    assert all(summary.materialized[a] == 1 for a in summary.global_assets)
    assert {"dataset_report", "image_energon_index", "diffusion_energon_index", "wdinfo"} <= set(summary.global_assets)
    assert again.ok and again.runs == 0
    assert not [p for p in s3_run["tmp"].rglob("*") if p.name.startswith("s3")], "a URL was used as a local path"
    assert not [p for p in fs.find(s3_run["root"]) if storage.TEMP_MARK in p]
    with fs.open(layout.report_html, "rb") as f:
        assert b"Dataset report" in f.read()
    for shard in summary.shards:  # one embedding row per sample, reordered rows line up with keys
        img = _npy(fs, layout.img_emb(shard))
        assert img.shape[0] == len(s3_run["keys"][shard]) and img.dtype == np.float16
        assert _npy(fs, layout.reordered_img(shard)).shape[0] == (15 if shard != "00002" else 12)
    # NeMo text2img outputs: wdinfo lists the complete balanced tars, precached tars follow them
    with fs.open(layout.balanced_wdinfo, "rb") as f:
        info = pickle.load(f)
    n_keys = sum(len(k) for k in s3_run["keys"].values())
    assert info["chunk_size"] == 10 and len(info["tar_files"]) == n_keys // 10
    with fs.open(layout.precached_wdinfo, "rb") as f:
        assert pickle.load(f)["tar_files"] == info["tar_files"]


def test_webdataset_reads_the_s3_tars(s3_run):
    fs, layout, keys = s3_run["fs"], s3_run["layout"], s3_run["keys"]
    shards = s3_run["summary"].shards
    urls = _presigned(fs, [layout.tar(s) for s in shards])
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))
    assert [s["__key__"] for s in samples] == [k for s in shards for k in keys[s]]
    assert all(s["jpg"].size == (32, 32) and s["json"]["key"] == s["__key__"] and isinstance(s["txt"], str)
               for s in samples)
    # NeMo's balanced tars: exactly chunk_size samples each
    with fs.open(layout.balanced_wdinfo, "rb") as f:
        info = pickle.load(f)
    balanced = _presigned(fs, [f"{layout.balanced_dir}/{name}" for name in info["tar_files"]])
    counts = {}
    for s in wds.WebDataset(balanced, shardshuffle=False):
        counts[s["__url__"]] = counts.get(s["__url__"], 0) + 1
    assert sorted(counts.values()) == [10] * len(balanced)
    diffusion = _presigned(fs, [layout.diffusion_tar(s) for s in shards])
    assert sorted(s["__key__"] for s in wds.WebDataset(diffusion, shardshuffle=False)) == sorted(
        k for s in shards for k in keys[s])


def _dalle2_decoder_loader():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("dalle2_pytorch")  # the package is found, never imported
    if spec is None:
        pytest.skip("dalle2-pytorch not installed (pip install --no-deps dalle2-pytorch==1.15.6): no oracle")
    path = Path(spec.submodule_search_locations[0]) / "dataloaders" / "decoder_loader.py"
    module_spec = importlib.util.spec_from_file_location("dalle2_s3_decoder_loader", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_dalle2_and_our_loader_read_tars_and_embeddings_from_s3(s3_run):
    import torchvision.transforms as T

    from shardprep.dataloaders import create_image_embedding_dataloader

    fs, layout, keys = s3_run["fs"], s3_run["layout"], s3_run["keys"]
    shards = s3_run["summary"].shards
    # the truth: each key's row of the reordered embeddings, read from S3
    truth = {}
    for shard in shards:
        rows = _npy(fs, layout.reordered_img(shard))
        truth.update({k: rows[index_of_key(k, 2)] for k in keys[shard]})
    # DALLE2 opens s3:// tars only through `pipe:s3cmd ...` (it refuses them without s3cmd installed):
    # presigned URLs are what it reads without; its embedding folders are s3:// URLs (fsspec)
    decoder_loader = _dalle2_decoder_loader()
    loader = decoder_loader.create_image_embedding_dataloader(
        tar_url=_presigned(fs, [layout.tar(s) for s in shards]), num_workers=1, batch_size=4,
        img_embeddings_url=layout.reordered_img_dir, text_embeddings_url=layout.reordered_text_dir,
        index_width=2, shuffle_shards=False, img_preproc=T.ToTensor(), extra_keys=["__key__"],
        handler=wds.handlers.reraise_exception)
    seen = {}
    for img, emb, batch_keys in loader:
        assert img.shape[1:] == (3, 32, 32)
        seen.update({k: emb["img"][i].numpy() for i, k in enumerate(batch_keys)})
    assert seen.keys() == truth.keys() and all(np.array_equal(seen[k], truth[k]) for k in truth)
    # ours takes the s3:// URLs as they are
    ours = create_image_embedding_dataloader(
        tar_url=[layout.tar(s) for s in shards], num_workers=0, batch_size=4,
        img_embeddings_url=layout.reordered_img_dir, text_embeddings_url=layout.reordered_text_dir,
        index_width=2, shuffle_shards=False, img_preproc=T.ToTensor(), extra_keys=["__key__"])
    got = {k: e for _, emb, batch_keys in ours for k, e in zip(batch_keys, emb["img"].numpy())}
    assert got.keys() == truth.keys() and all(np.array_equal(got[k], truth[k]) for k in truth)


def test_embedding_reader_reads_the_s3_embeddings(s3_run):
    from embedding_reader import EmbeddingReader

    fs, layout, keys = s3_run["fs"], s3_run["layout"], s3_run["keys"]
    expected = {}
    for shard in s3_run["summary"].shards:
        expected.update(zip(keys[shard], _npy(fs, layout.img_emb(shard)).astype(np.float32)))
    folder = layout.embeddings_dir  # an s3:// URL: embedding-reader lists and reads it through fsspec
    reader = EmbeddingReader(f"{folder}/img_emb", file_format="parquet_npy", meta_columns=["image_path", "caption"],
                             metadata_folder=f"{folder}/metadata")
    assert reader.count == len(expected) and reader.dimension == 32
    seen = {}
    for emb, meta in reader(batch_size=16, show_progress=False):
        seen.update(zip(meta["image_path"], emb))
    assert seen.keys() == expected.keys() and all(np.allclose(seen[k], expected[k]) for k in expected)


def test_energon_loads_both_indexes_from_s3(s3_run, tmp_path, monkeypatch):
    """energon 7.4 opens remote datasets through multi-storage-client (``msc://PROFILE/path``): a profile of
    type s3 (boto3) names the bucket; endpoint and credentials come from the AWS variables."""
    import torch
    from megatron.energon import Cooker, DefaultTaskEncoder, basic_sample_keys, stateless

    pytest.importorskip("boto3", reason="multi-storage-client's s3 provider needs boto3 (the test extra)")
    profile, config = write_msc_profile(s3_run["server"], tmp_path)
    monkeypatch.setenv("MSC_CONFIG", config)
    layout, keys = s3_run["layout"], s3_run["keys"]
    success = sorted(k for shard_keys in keys.values() for k in shard_keys)
    bucket_path = layout.root.removeprefix(f"s3://{s3_run['server'].bucket}/")
    images = f"msc://{profile}/{bucket_path}/images"
    train, val = energon_keys(images, "train"), energon_keys(images, "val")
    assert train and val and sorted(train + val) == success  # every sample once across the splits

    @stateless
    def cook(sample: dict) -> dict:
        return dict(**basic_sample_keys(sample), pth=sample[".pth"], json=sample[".json"])

    class Crude(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        @stateless
        def encode_sample(self, sample):
            assert sample["pth"].dtype == torch.bfloat16 and sample["json"]["source_key"] == sample["__key__"]
            return sample

        def batch(self, samples):
            return samples

    diffusion = f"msc://{profile}/{bucket_path}/diffusion"
    assert sorted(energon_keys(diffusion, "train", Crude()) + energon_keys(diffusion, "val", Crude())) == success


def test_verify_finds_damaged_s3_outputs_and_a_rerun_repairs_exactly_them(s3_run, monkeypatch):
    from shardprep_dagster.orchestration.verify import verify_dataset

    fs, layout, config, instance = s3_run["fs"], s3_run["layout"], s3_run["config"], s3_run["instance"]
    assert verify_dataset(config, instance, mark=False).ok
    fs.rm(layout.reordered_img("00002"))
    idx = f"{layout.tar('00001')}.idx"
    fs.pipe(idx, fs.cat(idx)[:-8])  # energon's per-tar index, one offset short
    report = verify_dataset(config, instance, mark=True)
    assert report.broken() == {"reordered_embeddings": ["00002"], "image_energon_index": ["_all"]}
    monkeypatch.chdir(s3_run["tmp"])
    repair = run_pipeline(config, instance=instance, progress=False, in_process=True)
    assert repair.ok and repair.runs > 0
    assert verify_dataset(config, instance, mark=False).ok
    assert not [p for p in fs.find(s3_run["root"]) if storage.TEMP_MARK in p]


# ---------------------------------------------------------------- the command line, configuration


def test_cli_run_on_s3_with_the_aws_variables_only(s3_env, tmp_path, image_site, tiny_clip_dir):
    """``shardprep run`` in a fresh process whose only S3 settings are the AWS variables; the config
    itself lives on S3 too."""
    server = s3_env
    fs = server.filesystem()
    root = f"s3://{server.bucket}/cli-{uuid.uuid4().hex[:8]}"
    _upload_sources(fs, tmp_path / "src", root, image_site[1], [8], seed=3)
    local = write_config(tmp_path / "c.yaml", source=f"{root}/source", output_root=f"{root}/out",
                         samples_per_shard=8, image_size=32, allow_private_addresses=True,
                         clip_model=f"hf_clip:{tiny_clip_dir}", batch_size=16, thread_count=8, timeout=5,
                         enable_nemo_text2img=False, enable_nemo_diffusion=False)
    fs.put_file(local, f"{root}/shardprep.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env(), DAGSTER_HOME=str(tmp_path / "home"), SHARDPREP_AUTOMATION="off",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "shardprep_dagster.orchestration.cli", "run", "--config", f"{root}/shardprep.yaml",
                          "--in-process"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    layout = Layout(f"{root}/out")
    assert fs.exists(layout.tar("00000")) and fs.exists(layout.reordered_img("00000"))
    assert fs.exists(f"{layout.images_dir}/.nv-meta/index.sqlite") and fs.exists(layout.report_html)
    assert not [p for p in fs.find(root) if storage.TEMP_MARK in p]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("s3")], "a URL was used as a local path"


def test_config_storage_options_reach_s3_without_aws_variables(s3_server, tmp_path, monkeypatch):
    from shardprep.config import ConfigError, load_config
    from shardprep.sources import list_source_files

    monkeypatch.setattr(fsspec.config, "conf", {})  # what configure() sets goes with the test
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))  # no ~/.aws profile either
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    root = f"s3://{s3_server.bucket}/options-{uuid.uuid4().hex[:8]}"
    s3_server.filesystem().pipe(f"{root}/source/a.parquet", b"not parquet, only listed")
    fields = dict(source=f"{root}/source", output_root=f"{root}/out")
    options = {"endpoint_url": s3_server.endpoint_url, "key": s3_server.access_key, "secret": s3_server.secret_key}
    cfg = load_config(write_config(tmp_path / "good.yaml", **fields, storage_options={"s3": options}))
    assert list_source_files(cfg.source) == [f"{root}/source/a.parquet"]
    assert s3_server.secret_key not in repr(cfg)
    storage.write_bytes(f"{root}/out/x.bin", b"through the config's options")
    assert storage.read_bytes(f"{root}/out/x.bin") == b"through the config's options"
    # a typo fails at load, naming the option, with the secret masked
    bad = write_config(tmp_path / "bad.yaml", **fields,
                       storage_options={"s3": {"endpoint": s3_server.endpoint_url, "secret": "s3cr3t"}})
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    message = str(err.value)
    assert "config field 'storage_options'" in message and "unknown option 'endpoint'" in message
    assert "did you mean 'endpoint_url'?" in message and "s3cr3t" not in message


# ---------------------------------------------------------------- storage on S3


def test_the_server_refuses_requests_without_the_credentials(s3_server):
    # weed mini serves anyone when started without credentials: this one must not, or the tests above
    # would pass with the AWS variables ignored
    import s3fs

    for kwargs in ({"anon": True}, {"key": s3_server.access_key, "secret": "wrong"}):
        fs = s3fs.S3FileSystem(endpoint_url=s3_server.endpoint_url, skip_instance_cache=True, **kwargs)
        with pytest.raises(PermissionError):
            fs.ls(s3_server.bucket)


def test_files_written_by_another_process_are_seen_at_once(s3_env):
    """A folder listed once must not hide what other processes (Dagster runs, workers) write there later."""
    other = s3_env.filesystem()  # another process's view: its own connection, no shared cache
    root = f"s3://{s3_env.bucket}/listing-{uuid.uuid4().hex[:8]}"
    other.pipe(f"{root}/a.txt", b"1")
    fs, path = storage.url_to_fs(root)
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)] == ["a.txt"]
    size_before, stamp_before = storage.stat(f"{root}/a.txt")
    other.pipe(f"{root}/b.txt", b"22")
    other.pipe(f"{root}/a.txt", b"333")
    assert storage.exists(f"{root}/b.txt") and storage.read_text(f"{root}/b.txt") == "22"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.glob(f"{path}/*.txt")) == ["a.txt", "b.txt"]
    size, stamp = storage.stat(f"{root}/a.txt")
    assert (size_before, size) == (1, 3) and stamp != stamp_before


def test_lock_on_an_s3_root_serialises_and_stays_local(s3_env):
    root = f"s3://{s3_env.bucket}/lock-{uuid.uuid4().hex[:8]}"
    order, inside = [], threading.Event()

    def holder():
        with storage.lock(root, "ledger"):
            inside.set()
            order.append("first in")
            threading.Event().wait(0.3)
            order.append("first out")

    t = threading.Thread(target=holder)
    t.start()
    inside.wait(10)
    with storage.lock(root, "ledger"):  # waits for the holder: a flock on a separate open file
        order.append("second in")
    t.join(10)
    assert order == ["first in", "first out", "second in"]
    assert not s3_env.filesystem().exists(root)  # nothing of the lock goes to the bucket


KILLED_WRITER = """
import os, signal, sys
from shardprep import storage
with storage.atomic_write(sys.argv[1]) as f:
    f.write(b"half of the new content")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""

# a real multipart upload (5 MiB parts, 3 of them) killed once its first part is stored
KILLED_MULTIPART = """
import os, signal, sys
import s3fs
from shardprep import storage

put, call = s3fs.S3FileSystem._put_file, s3fs.S3FileSystem._call_s3

async def small_parts(self, lpath, rpath, *args, **kwargs):
    return await put(self, lpath, rpath, *args, **{**kwargs, "chunksize": 5 * 2**20})

async def die_after_a_part(self, method, *args, **kwargs):
    out = await call(self, method, *args, **kwargs)
    if method == "upload_part":
        os.kill(os.getpid(), signal.SIGKILL)
    return out

s3fs.S3FileSystem._put_file, s3fs.S3FileSystem._call_s3 = small_parts, die_after_a_part
with storage.atomic_write(sys.argv[1]) as f:
    f.write(os.urandom(12 * 2**20))
"""


@pytest.mark.parametrize("code", [KILLED_WRITER, KILLED_MULTIPART], ids=["inside-the-block", "mid-multipart"])
def test_a_killed_write_leaves_the_old_object_or_none(s3_env, tmp_path, monkeypatch, code):
    fs = s3_env.filesystem()
    root = f"s3://{s3_env.bucket}/killed-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(CHECKOUT)}
    for target, old in ((f"{root}/new.tar", None), (f"{root}/old.tar", b"the old content")):
        if old is not None:
            storage.write_bytes(target, old)
        proc = subprocess.run([sys.executable, "-c", code, target], env=env, capture_output=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        assert fs.cat(target) == old if old is not None else not fs.exists(target)
    assert [p.rsplit("/", 1)[-1] for p in fs.find(root)] == ["old.tar"]
    if code is KILLED_MULTIPART:  # it died mid-upload: the server holds parts of an upload never completed
        bucket, _, prefix = root.removeprefix("s3://").partition("/")
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
        assert {u["Key"] for u in uploads} == {f"{prefix}/new.tar", f"{prefix}/old.tar"}
    # a dead writer's local upload file is removed by the next write (the second run removed the first's)
    uploads_dir = tmp_path / "shardprep-uploads"
    assert len(list(uploads_dir.iterdir())) == 1
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    storage.write_bytes(f"{root}/next.bin", b"x")
    assert list(uploads_dir.iterdir()) == []
