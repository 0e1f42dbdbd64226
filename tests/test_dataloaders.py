"""shardprep.dataloaders against DALLE2-pytorch 1.15.6's own loaders (the oracle) and ground truth.

The oracle modules are loaded by file path, so dalle2_pytorch's heavy ``__init__`` never runs:
install it with ``pip install --no-deps dalle2-pytorch==1.15.6``. Where DALLE2 has a known bug
(workers read every shard, num_workers=0 crashes, shuffle_num is a no-op, extra files crash,
start>0 trims train only, small splits × many ranks assert, prior workers duplicate) the test
asserts the bug too, so the fix stays documented by a check that would notice a change.
"""

import gc
import importlib.metadata
import importlib.util
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import clip
import fsspec
import numpy as np
import pytest
import torch
import torchvision.transforms as T
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader

import shardprep.dataloaders.prior as prior
from shardprep.dataloaders import (
    ImageEmbeddingDataset,
    PriorEmbeddingDataset,
    create_image_embedding_dataloader,
    get_reader,
    make_splits,
)
from shardprep.dataloaders.worker import start_worker
from tests.fixtures.dataloader_data import build_loader_dataset

DALLE2_VERSION = "1.15.6"
EXTRA = ["__key__", "txt"]
TO_TENSOR = T.ToTensor()

# DALLE2 pins pin_memory=True; on a CPU-only machine torch warns about it
pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")


def _load_oracle(name: str):
    spec = importlib.util.find_spec("dalle2_pytorch")  # locates the package without importing it
    if spec is None:
        pytest.skip(f"dalle2-pytorch not installed (pip install --no-deps dalle2-pytorch=={DALLE2_VERSION}): no oracle")
    version = importlib.metadata.version("dalle2-pytorch")
    if version != DALLE2_VERSION:
        pytest.skip(f"oracle must be dalle2-pytorch {DALLE2_VERSION}, found {version}")
    path = Path(spec.submodule_search_locations[0]) / "dataloaders" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"dalle2_oracle_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dalle2_decoder():
    return _load_oracle("decoder_loader")


@pytest.fixture(scope="module")
def dalle2_prior():
    return _load_oracle("prior_loader")


@pytest.fixture(scope="module")
def data10(tmp_path_factory):
    """10 samples/shard: keys of 6 digits (5 shard + 1 index), index_width 1."""
    return build_loader_dataset(str(tmp_path_factory.mktemp("spp10")), samples_per_shard=10)


@pytest.fixture(scope="module")
def data10k(tmp_path_factory):
    """10000 samples/shard: keys of 9 digits, index_width 4 (DALLE2's usual setting)."""
    return build_loader_dataset(str(tmp_path_factory.mktemp("spp10k")), samples_per_shard=10000, seed=1)


@pytest.fixture(params=["data10", "data10k"])
def data(request):
    return request.getfixturevalue(request.param)


def _loader(create, data, num_workers, batch_size, **kw):
    """A decoder dataloader from ``create`` (ours or DALLE2's) over ``data``, with the shared test settings."""
    # DALLE2's forked workers inherit, and finalize themselves, earlier loaders' iterators that tests
    # leave in reference cycles (pytest.raises); ours freeze them out (start_worker). On CPython 3.11.7
    # that broke a worker's first np.load now and then ("AST constructor recursion depth mismatch",
    # gh-106905), which DALLE2's loader under ignore_and_continue turns into a silently dropped shard.
    if num_workers > 0:
        gc.collect()
    args = dict(
        img_embeddings_url=data.layout.reordered_img_dir,
        text_embeddings_url=data.layout.reordered_text_dir,
        index_width=data.index_width,
        shuffle_shards=False,
        img_preproc=TO_TENSOR,
        extra_keys=EXTRA,
    )
    args.update(kw)
    tar_url = args.pop("tar_url", data.tar_pattern)
    return create(tar_url, num_workers, batch_size, **args)


def ours(data, num_workers=0, batch_size=4, **kw):
    return _loader(create_image_embedding_dataloader, data, num_workers, batch_size, **kw)


def theirs(oracle, data, num_workers=1, batch_size=4, **kw):
    return _loader(oracle.create_image_embedding_dataloader, data, num_workers, batch_size, **kw)


def samples(loader):
    """Unbatch ``(img, emb, keys, txts)`` batches into ``(key, img, {kind: emb}, txt)``."""
    out = []
    for img, emb, keys, txts in loader:
        assert img.shape[0] == len(keys)
        out.extend((key, img[i], {kind: v[i] for kind, v in emb.items()}, txts[i]) for i, key in enumerate(keys))
    return out


def keys_of(loader):
    return [s[0] for s in samples(loader)]


def assert_same_batches(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for batch_a, batch_b in zip(a, b):
        assert len(batch_a) == len(batch_b)
        for x, y in zip(batch_a, batch_b):
            if isinstance(x, dict):
                assert list(x) == list(y)
                for kind in x:
                    assert x[kind].dtype == y[kind].dtype and torch.equal(x[kind], y[kind])
            elif isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y)
            else:
                assert list(x) == list(y)


def assert_ground_truth(data, got):
    for key, img, emb, txt in got:
        truth = TO_TENSOR(Image.open(io.BytesIO(data.jpg[key])).convert("RGB"))
        assert torch.equal(img, truth), key
        assert torch.equal(emb["img"], torch.from_numpy(data.img_emb[key])), key
        assert torch.equal(emb["text"], torch.from_numpy(data.text_emb[key])), key
        assert txt == data.caption[key]


def copy_dataset(data, dest: Path) -> Path:
    shutil.copytree(data.root, dest)
    return dest


# --- decoder loader -------------------------------------------------------------------------


def test_batches_match_dalle2_and_ground_truth(data, dalle2_decoder):
    assert_same_batches(ours(data, num_workers=1), theirs(dalle2_decoder, data, num_workers=1))
    got = samples(ours(data))
    assert [s[0] for s in got] == data.keys  # failed samples (holes) are simply absent
    assert len(data.keys) == 21 and not set(data.failed_keys) & set(data.keys)
    assert all(s[2]["img"].dtype == torch.float16 for s in got)
    assert_ground_truth(data, got)


def test_batch_structure(data10):
    img, emb, keys, txts = next(iter(ours(data10, batch_size=4)))
    assert img.shape == (4, 3, 32, 32)
    assert list(emb) == ["text", "img"] and emb["img"].shape == (4, 8) and emb["text"].shape == (4, 8)
    assert list(keys) == data10.keys[:4] and list(txts) == [data10.caption[k] for k in data10.keys[:4]]


def test_workers_read_each_sample_once(data10, dalle2_decoder):
    for shuffle_shards in (False, True):
        got = keys_of(ours(data10, num_workers=2, shuffle_shards=shuffle_shards))
        assert Counter(got) == Counter(data10.keys)
    # the bug being fixed: every DALLE2 worker reads every shard
    doubled = Counter(keys_of(theirs(dalle2_decoder, data10, num_workers=2)))
    assert doubled == Counter({key: 2 for key in data10.keys})


def test_num_workers_zero(data10, dalle2_decoder):
    assert keys_of(ours(data10, num_workers=0)) == data10.keys
    with pytest.raises(ValueError, match="prefetch_factor"):
        theirs(dalle2_decoder, data10, num_workers=0)


class _Garbage:
    """A reference cycle, so only the garbage collector frees it; its finalizer logs the process it ran in."""

    def __init__(self, log: Path):
        self.log, self.me = log, self

    def __del__(self):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_workers_leave_the_parents_garbage_alone(data10, tmp_path):
    """A forked worker must not finalize what its parent left for the collector (see ``start_worker``)."""
    log = tmp_path / "finalized"

    def collect_then_tensor(img):
        gc.collect()  # runs in the worker: a collection there, as allocations would trigger one
        return TO_TENSOR(img)

    gc.disable()  # keep the garbage uncollected here until the worker has forked
    try:
        _Garbage(log)
        loader = create_image_embedding_dataloader(
            data10.tar_pattern, 1, 4, img_embeddings_url=data10.layout.reordered_img_dir,
            text_embeddings_url=data10.layout.reordered_text_dir, index_width=data10.index_width,
            shuffle_shards=False, img_preproc=collect_then_tensor, extra_keys=EXTRA)
        got = keys_of(loader)
    finally:
        gc.enable()
    gc.collect()
    assert got == data10.keys
    assert log.read_text().split() == [str(os.getpid())]  # finalized once, here


def test_ranks_split_shards(data10):
    per_rank = [keys_of(ours(data10, num_workers=2, rank=r, world_size=2)) for r in range(2)]
    assert all(per_rank) and not set(per_rank[0]) & set(per_rank[1])
    assert Counter(per_rank[0] + per_rank[1]) == Counter(data10.keys)
    # 3 shards over 4 ranks: the last rank has none and yields nothing
    four = [keys_of(ours(data10, rank=r, world_size=4, shuffle_shards=True)) for r in range(4)]
    assert four[3] == [] and Counter(sum(four, [])) == Counter(data10.keys)
    with pytest.raises(ValueError, match="rank"):
        ours(data10, rank=2, world_size=2)


def test_resample_draws_from_associated_shards(data10):
    dataset = ImageEmbeddingDataset(
        data10.tar_pattern, data10.layout.reordered_img_dir, index_width=1, resample=True, shuffle_shards=False,
        img_preproc=TO_TENSOR, extra_keys=["__key__"],
    )
    drawn = [key for _, _, key in itertools.islice(iter(dataset), 60)]  # endless: shards drawn with replacement
    assert len(drawn) == 60 and set(drawn) <= set(data10.keys)
    with pytest.raises(ValueError, match="no tar shard"):
        ImageEmbeddingDataset(f"{data10.layout.images_dir}/{{00007..00009}}.tar", data10.layout.reordered_img_dir, index_width=1)


def test_shuffle_num_shuffles_samples(data10, dalle2_decoder):
    assert keys_of(ours(data10, shuffle_num=None)) == data10.keys
    assert keys_of(ours(data10, shuffle_num=0)) == data10.keys
    shuffled = samples(ours(data10, shuffle_num=50, seed=3))
    order = [s[0] for s in shuffled]
    assert order != data10.keys and sorted(order) == sorted(data10.keys)
    assert_ground_truth(data10, shuffled)  # images and embeddings stay paired
    assert keys_of(ours(data10, shuffle_num=50, seed=3)) == order  # seeded: reproducible
    assert keys_of(ours(data10, shuffle_num=50, seed=4)) != order
    with_workers = keys_of(ours(data10, num_workers=2, shuffle_num=50))
    assert Counter(with_workers) == Counter(data10.keys)
    # the bug being fixed: DALLE2 discards its shuffle stage
    assert keys_of(theirs(dalle2_decoder, data10, shuffle_num=50)) == data10.keys


def test_readme_parameter_names(data):
    common = dict(shuffle_shards=False, img_preproc=TO_TENSOR, extra_keys=EXTRA)
    new = list(create_image_embedding_dataloader(
        data.tar_pattern, 0, 4, img_embeddings_url=data.layout.reordered_img_dir, index_width=data.index_width, **common
    ))
    readme_loader = create_image_embedding_dataloader(
        tar_url=data.tar_pattern, embeddings_url=data.layout.reordered_img_dir, num_workers=0, batch_size=4,
        shard_width=data.shard_width, **common,
    )
    readme_dataset = ImageEmbeddingDataset(
        urls=data.tar_pattern, embedding_folder_url=data.layout.reordered_img_dir, shard_width=data.shard_width, **common
    )
    assert_same_batches(new, readme_loader)
    assert_same_batches(new, DataLoader(readme_dataset, batch_size=4))
    assert list(new[0][1]) == ["img"]
    assert [k for batch in new for k in batch[2]] == data.keys


def test_parameter_errors(data10):
    img_dir = data10.layout.reordered_img_dir
    with pytest.raises(ValueError, match="embeddings_url"):
        ours(data10, embeddings_url=img_dir)  # both the new and the README name
    with pytest.raises(ValueError, match="shard_width"):
        ours(data10, shard_width=5)  # both widths
    with pytest.raises(TypeError, match="index_width"):
        ImageEmbeddingDataset(data10.tar_pattern, img_dir, 1)  # old positional width
    with pytest.raises(ValueError, match="index_width"):
        ImageEmbeddingDataset(data10.tar_pattern, img_dir)
    with pytest.raises(ValueError, match="resample"):
        ImageEmbeddingDataset(data10.tar_pattern, img_dir, index_width=1, resample=True)
    bad = [f"{data10.layout.images_dir}/first.tar"]
    with pytest.raises(ValueError, match="first.tar"):
        ImageEmbeddingDataset(bad, img_dir, index_width=1)


def test_fsspec_urls(data10, dalle2_decoder):
    plain = list(ours(data10))
    file_url = "file://" + data10.root
    assert_same_batches(plain, ours(
        data10,
        tar_url="file://" + data10.tar_pattern,
        img_embeddings_url=file_url + "/embeddings_reordered/img",
        text_embeddings_url=file_url + "/embeddings_reordered/text",
    ))
    # an object store that webdataset's own URL opener cannot read
    memory = fsspec.filesystem("memory")
    memory.put(data10.root, "/loader-test", recursive=True)
    try:
        tar_url = "memory://loader-test/images/{00000..00002}.tar"
        mem = dict(tar_url=tar_url, img_embeddings_url="memory://loader-test/embeddings_reordered/img",
                   text_embeddings_url="memory://loader-test/embeddings_reordered/text")
        assert_same_batches(plain, ours(data10, **mem))
        assert Counter(keys_of(ours(data10, num_workers=2, **mem))) == Counter(data10.keys)
        # DALLE2 opens tars with webdataset's gopen, which knows no memory:// (its folder `ls`
        # also breaks on memory://, which lists dicts), so give it local embeddings
        with pytest.raises(ValueError, match="no gopen handler"):
            list(theirs(dalle2_decoder, data10, tar_url=tar_url))
    finally:
        memory.rm("/loader-test", recursive=True)


def test_other_files_in_embedding_folder_are_ignored(data10, dalle2_decoder, tmp_path):
    root = copy_dataset(data10, tmp_path / "ds")
    img_dir = root / "embeddings_reordered" / "img"
    (img_dir / "README.md").write_text("embeddings")
    (img_dir / ".DS_Store").write_bytes(b"\0")
    (img_dir / ".img_emb_00001.npy.tmp-0123456789ab").write_bytes(b"half written")
    (img_dir / "stats_summary.json").write_text("{}")
    (img_dir / "old_00001").mkdir()
    got = list(ours(data10, img_embeddings_url=str(img_dir)))
    assert_same_batches(got, ours(data10))
    with pytest.raises(ValueError, match="invalid literal for int"):
        list(theirs(dalle2_decoder, data10, img_embeddings_url=str(img_dir)))


def test_zero_or_missing_row_raises_like_dalle2(data10, dalle2_decoder, tmp_path):
    root = copy_dataset(data10, tmp_path / "ds")
    npy = root / "embeddings_reordered" / "img" / "img_emb_00001.npy"
    table = np.load(npy)
    holed = table.copy()
    holed[1] = 0  # key 000011 is in the tar but its embedding row is a hole
    np.save(npy, holed)
    dirs = dict(img_embeddings_url=str(npy.parent), text_embeddings_url=str(root / "embeddings_reordered" / "text"))
    with pytest.raises(RuntimeError, match="000011"):
        list(ours(data10, **dirs))
    with pytest.raises(RuntimeError, match="no embedding was found"):
        list(theirs(dalle2_decoder, data10, **dirs))
    skip = wds.handlers.ignore_and_continue
    expected = [k for k in data10.keys if k != "000011"]
    assert keys_of(ours(data10, handler=skip, **dirs)) == expected
    assert keys_of(theirs(dalle2_decoder, data10, handler=skip, **dirs)) == expected
    # a file shorter than the tar's indices: a clear RuntimeError naming the file (DALLE2: IndexError)
    np.save(npy, table[:3])
    with pytest.raises(RuntimeError, match="img_emb_00001.npy has 3 rows"):
        list(ours(data10, **dirs))
    with pytest.raises(IndexError):
        list(theirs(dalle2_decoder, data10, **dirs))


def test_shards_without_embeddings_are_skipped(data10, dalle2_decoder, tmp_path):
    root = copy_dataset(data10, tmp_path / "ds")
    (root / "embeddings_reordered" / "text" / "text_emb_00001.npy").unlink()
    dirs = dict(img_embeddings_url=str(root / "embeddings_reordered" / "img"),
                text_embeddings_url=str(root / "embeddings_reordered" / "text"))
    expected = [k for k in data10.keys if not k.startswith("00001")]
    assert keys_of(ours(data10, **dirs)) == expected
    assert keys_of(theirs(dalle2_decoder, data10, **dirs)) == expected


def test_missing_tar_goes_through_the_handler(data10, tmp_path):
    root = copy_dataset(data10, tmp_path / "ds")
    (root / "images" / "00001.tar").unlink()
    kw = dict(tar_url=f"{root}/images/{{00000..00002}}.tar")
    with pytest.raises(FileNotFoundError, match="00001.tar"):
        list(ours(data10, num_workers=2, **kw))
    expected = [k for k in data10.keys if not k.startswith("00001")]
    assert keys_of(ours(data10, handler=wds.handlers.ignore_and_continue, **kw)) == expected


RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
from shardprep.dataloaders import ImageEmbeddingDataset
rank, init, tars, emb, width = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
dataset = ImageEmbeddingDataset(tars, emb, index_width=width, shuffle_shards=False, extra_keys=["__key__"])
print(json.dumps([dataset.rank, dataset.world_size, [key for _, _, key in dataset]]))
dist.barrier()
dist.destroy_process_group()
"""


def test_rank_defaults_to_torch_distributed(data10, tmp_path):
    init = f"file://{tmp_path}/process-group"
    args = [data10.tar_pattern, data10.layout.reordered_img_dir, str(data10.index_width)]
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), init, *args], stdout=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    results = [json.loads(proc.communicate(timeout=120)[0].strip().splitlines()[-1]) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert [r[:2] for r in results] == [[0, 2], [1, 2]]
    assert results[0][2] and results[1][2]
    assert Counter(results[0][2] + results[1][2]) == Counter(data10.keys)


def test_without_embedding_folders_emb_is_empty(data10, dalle2_decoder):
    kw = dict(img_embeddings_url=None, text_embeddings_url=None, index_width=None)
    assert_same_batches(ours(data10, **kw), theirs(dalle2_decoder, data10, **kw))
    assert next(iter(ours(data10, **kw)))[1] == {}


# --- prior loader ---------------------------------------------------------------------------


def _readers(module, data, text_conditioned):
    emb = data.layout.embeddings_dir
    if text_conditioned:
        return module.get_reader(True, img_url=f"{emb}/img_emb", meta_url=f"{emb}/metadata"), None
    return module.get_reader(False, img_url=f"{emb}/img_emb", txt_url=f"{emb}/text_emb")


def _rows(data, batches, text_conditioned):
    """Global reader rows of a split, checked against ground truth batch by batch."""
    index = {data.img_emb[k].astype(np.float32).tobytes(): i for i, k in enumerate(data.keys)}
    rows = []
    for img, second in batches:
        assert img.dtype == torch.float32
        batch_rows = [index[r.numpy().tobytes()] for r in img]
        keys = [data.keys[i] for i in batch_rows]
        if text_conditioned:
            assert torch.equal(second, clip.tokenize([data.caption[k] for k in keys], truncate=True))
        else:
            assert torch.equal(second, torch.from_numpy(np.stack([data.text_emb[k] for k in keys]).astype(np.float32)))
        rows.extend(batch_rows)
    return rows


def test_get_reader_matches_dalle2(data10, dalle2_prior):
    reader, _ = _readers(prior, data10, True)
    oracle, _ = _readers(dalle2_prior, data10, True)
    assert reader.count == oracle.count == len(data10.keys) and reader.dimension == 8
    pair = _readers(prior, data10, False)
    assert isinstance(pair, tuple) and [r.count for r in pair] == [21, 21]
    with pytest.raises(ValueError, match="meta_url"):
        get_reader(True, img_url=f"{data10.layout.embeddings_dir}/img_emb")


@pytest.mark.parametrize("text_conditioned", [True, False])
@pytest.mark.parametrize("num_data_points", [1000, 15])
def test_splits_match_dalle2(data10, dalle2_prior, text_conditioned, num_data_points):
    image_reader, text_reader = _readers(prior, data10, text_conditioned)
    for rank, world_size in [(0, 1), (0, 2), (1, 2)]:
        args = (text_conditioned, 4, num_data_points, 0.6, 0.2, image_reader, text_reader, 0, rank, world_size)
        mine, oracle = make_splits(*args), dalle2_prior.make_splits(*args)
        for split_mine, split_oracle in zip(mine, oracle):
            assert_same_batches(split_mine, split_oracle)
        if world_size == 1:
            total = min(num_data_points, 21)
            train, val, test = (_rows(data10, split, text_conditioned) for split in mine)
            assert train == list(range(0, int(0.6 * total)))
            assert val == list(range(int(0.6 * total), int(0.6 * total) + int(0.2 * total)))
            assert test == list(range(len(train) + len(val), total))


def test_start_shifts_every_split(data10, dalle2_prior):
    image_reader, _ = _readers(prior, data10, True)
    for start, num_data_points in [(5, 1000), (3, 10)]:
        total = min(num_data_points, 21 - start)
        n_train, n_val = int(0.6 * total), int(0.2 * total)
        train, val, test = (_rows(data10, s, True) for s in make_splits(True, 4, num_data_points, 0.6, 0.2, image_reader, start=start))
        assert train == list(range(start, start + n_train))
        assert val == list(range(start + n_train, start + n_train + n_val))
        assert test == list(range(start + n_train + n_val, start + total))
        # the bug being fixed: DALLE2 cuts train at int(0.6 * N) counted from 0, not from start
        d_train, _, d_test = dalle2_prior.make_splits(True, 4, num_data_points, 0.6, 0.2, image_reader, start=start)
        n = num_data_points if num_data_points <= 21 - start else 21
        assert len(d_train.dataset) == int(0.6 * n) - start
        assert d_test.dataset.stop == n


def test_small_split_over_many_ranks(data10, dalle2_prior):
    image_reader, _ = _readers(prior, data10, True)
    per_rank = [make_splits(True, 4, 1000, 0.8, 0.1, image_reader, rank=r, world_size=4) for r in range(4)]
    for split, (begin, end) in enumerate([(0, 16), (16, 18), (18, 21)]):
        rows = [_rows(data10, loaders[split], True) for loaders in per_rank]
        assert sorted(sum(rows, [])) == list(range(begin, end))  # every row once over the ranks
    assert [len(loaders[1].dataset) for loaders in per_rank] == [1, 1, 0, 0]
    assert _rows(data10, per_rank[3][2], True) == []
    with pytest.raises(AssertionError):
        dalle2_prior.make_splits(True, 4, 1000, 0.8, 0.1, image_reader, rank=3, world_size=4)
    empty_eval = make_splits(True, 4, 1000, 0.8, 0.0, image_reader)[1]
    assert list(empty_eval) == []
    with pytest.raises(ValueError, match="test split"):
        make_splits(True, 4, 1000, 0.8, 0.2, image_reader)


@pytest.mark.parametrize("text_conditioned", [True, False])
def test_prior_workers_do_not_duplicate(data10, dalle2_prior, text_conditioned):
    image_reader, text_reader = _readers(prior, data10, text_conditioned)
    single = list(make_splits(text_conditioned, 4, 1000, 0.6, 0.2, image_reader, text_reader)[0])
    splits = make_splits(text_conditioned, 4, 1000, 0.6, 0.2, image_reader, text_reader, num_workers=2)
    assert all(loader.worker_init_fn is start_worker for loader in splits)  # the parent's garbage left alone
    multi = list(splits[0])
    assert sorted(_rows(data10, multi, text_conditioned)) == list(range(12))
    by_first_row = lambda batches: sorted(batches, key=lambda b: b[0][0].tolist())  # noqa: E731
    assert_same_batches(by_first_row(single), by_first_row(multi))  # same batches, worker order aside
    ds = PriorEmbeddingDataset(text_conditioned, 4, 0, 12, image_reader, text_reader)
    assert len(ds) == 12 and str(ds).startswith("<PriorEmbeddingDataset")
    # the bug being fixed: DALLE2's dataset ignores workers, each reads the whole split
    oracle = dalle2_prior.PriorEmbeddingDataset(text_conditioned, 4, 0, 12, image_reader, text_reader)
    twice = _rows(data10, DataLoader(oracle, batch_size=None, num_workers=2), text_conditioned)
    assert Counter(twice) == Counter({row: 2 for row in range(12)})


def test_builder_layout(data10k):
    """The fixture writes what shardprep writes: 9-digit keys, float16 rows with zero holes."""
    assert data10k.index_width == 4 and all(len(k) == 9 for k in data10k.keys)
    table = np.load(data10k.layout.reordered_img("00001"))
    assert table.dtype == np.float16 and table.shape == (8, 8)
    assert not table[5].any() and "000010005" in data10k.failed_keys
    assert np.array_equal(table[3], data10k.img_emb["000010003"])
    assert len(np.load(data10k.layout.img_emb("00001"))) == 7  # clip-retrieval layout: successes only
