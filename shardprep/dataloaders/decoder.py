"""DALLE2-pytorch's decoder loader (image + CLIP embeddings from webdataset tars), bugs fixed.

Yields what ``dalle2_pytorch.dataloaders.decoder_loader`` 1.15.6 yields: batches
``(img, emb, *extra_keys)`` with ``emb = {'text': Tensor[B, D], 'img': Tensor[B, D]}`` holding
the folders that were given (dtype of the ``.npy`` files kept). Fixed here:

- shards are split across ranks and DataLoader workers, so no sample is read twice (DALLE2's
  every worker reads every shard);
- ``num_workers=0`` works (DALLE2 always passes ``prefetch_factor``, which torch>=2 rejects);
- ``shuffle_num`` shuffles samples with that buffer (DALLE2 discards its ``ds.shuffle(1000)``);
- tars are opened through fsspec (local paths, ``file://``, ``s3://``, ``memory://`` …);
  ``pipe:`` URLs still go to webdataset's opener;
- embedding folders may hold other files (README, temp files, subfolders): only
  ``<prefix>_<int>.npy`` files are read, one per shard id, whatever the padding.

Parameter names of DALLE2's README are accepted too: ``embeddings_url`` /
``embedding_folder_url`` mean the image-embedding folder, and ``shard_width=s`` means the key
is ``s`` shard characters followed by the row index (index = ``int(key[s:])``, the README's
convention), whereas ``index_width=w`` takes the last ``w`` characters (``int(key[-w:])``).
For shardprep's keys (5 shard digits + ``oom_sample`` index digits) ``shard_width=5`` and
``index_width=oom_sample`` give the same row. The embeddings still come back as
``emb = {'img': ...}`` (the current API), not the README's bare tensor.
"""

import random

import braceexpand
import fsspec
import torch
import webdataset as wds
from torch.utils.data import DataLoader

from shardprep.tars import group_samples, iter_members

from .distributed import resolve_rank, split_by_rank, split_by_worker, worker_info
from .embedding_files import list_embedding_files, load_embeddings, shard_id_of_url
from .worker import start_worker

EMBEDDING_SAMPLE_KEYS = {"img": "img_emb", "text": "text_emb"}


def expand_urls(urls) -> list[str]:
    """Brace-expand a URL pattern or a list of them (``/data/{00000..00009}.tar``)."""
    if isinstance(urls, str):
        urls = [urls]
    return [url for pattern in urls for url in braceexpand.braceexpand(pattern)]


def row_of_key(key: str, index_width: int | None = None, shard_width: int | None = None) -> int:
    """Embedding row of a sample key: last ``index_width`` chars, or all after ``shard_width``."""
    if index_width is not None:
        return int(key[-index_width:])
    return int(key[shard_width:])


def _open_stream(url: str):
    if url.startswith("pipe:"):
        return wds.gopen.gopen(url)
    return fsspec.open(url, "rb").open()


def open_shards(sources, handler=wds.handlers.reraise_exception):
    """Open each ``{"url": ...}`` through fsspec; the stream is closed once its tar is read."""
    for source in sources:
        url = source["url"]
        try:
            stream = _open_stream(url)
        except Exception as exn:
            exn.args = exn.args + (url,)
            if handler(exn):
                continue
            break
        try:
            # resumed only after tar_file_expander has read the whole stream
            yield dict(source, stream=stream)
        finally:
            stream.close()


def tar_samples(sources, handler=wds.handlers.reraise_exception):
    """webdataset's ``tarfile_to_samples`` (``tar_file_expander`` + ``group_by_keys``: same
    samples, same grouping, same errors through ``handler``) with fsspec instead of its URL opener
    and shardprep's direct tar-header parser instead of ``tarfile`` (several times less Python
    work per member, which is most of a small sample's loading cost)."""
    for source in open_shards(sources, handler=handler):
        url = source["url"]
        if not (yield from group_samples(iter_members(source["stream"], url), url, handler=handler)):
            return


def shuffle_list(src, seed=None, rank=0):
    """Shuffle this worker's own shard list (after splitting, so coverage never depends on seeds)."""
    items = list(src)
    worker, _ = worker_info()
    random.Random(None if seed is None else f"shards-{seed}-{rank}-{worker}").shuffle(items)
    yield from items


def shuffle_samples(src, bufsize: int, seed=None, rank=0):
    """webdataset's buffer shuffle with an RNG per worker (seeded when ``seed`` is given)."""
    worker, _ = worker_info()
    rng = random.Random(None if seed is None else f"samples-{seed}-{rank}-{worker}")
    yield from wds.filters.shuffle(bufsize=bufsize, initial=min(100, bufsize), rng=rng)(iter(src))


def insert_embeddings(samples, files, index_width=None, shard_width=None, handler=wds.handlers.reraise_exception):
    """Add ``img_emb``/``text_emb`` (row of the shard's ``.npy``) and ``emb`` to each sample.

    ``files`` maps ``"img"``/``"text"`` to ``{shard id: npy URL}``. A row that is all zeros
    (a failed sample) or past the end raises RuntimeError through ``handler``, as in DALLE2.
    """
    current_url, current = None, {}
    for sample in samples:
        try:
            url, key = sample["__url__"], sample["__key__"]
            if url != current_url:
                # samples arrive grouped by tar (shuffling comes later), so one shard is cached
                current_url, current = None, {}
                shard = shard_id_of_url(url)
                current = {kind: (by_shard[shard], load_embeddings(by_shard[shard])) for kind, by_shard in files.items()}
                current_url = url
            row = row_of_key(key, index_width, shard_width)
            emb = {}
            for kind in ("text", "img"):  # DALLE2's order of the `emb` dict
                if kind not in current:
                    continue
                npy_url, table = current[kind]
                if not 0 <= row < len(table):
                    raise RuntimeError(
                        f"Webdataset had a sample, but no embedding was found: key {key} of {url} "
                        f"wants row {row} but {npy_url} has {len(table)} rows"
                    )
                embedding = table[row]
                if torch.count_nonzero(embedding) == 0:
                    raise RuntimeError(
                        f"Webdataset had a sample, but no embedding was found: key {key} of {url} "
                        f"has an all-zero row {row} in {npy_url}"
                    )
                sample[EMBEDDING_SAMPLE_KEYS[kind]] = emb[kind] = embedding
            sample["emb"] = emb
            yield sample
        except Exception as exn:
            if handler(exn):
                continue
            break


def add_empty_embeddings(samples):
    """Without embedding folders DALLE2 still yields ``emb = {}``."""
    for sample in samples:
        sample["emb"] = {}
        yield sample


def verify_keys(samples, required_keys, handler=wds.handlers.reraise_exception):
    for sample in samples:
        try:
            missing = [key for key in required_keys if key not in sample]
            if missing:
                raise KeyError(
                    f"sample {sample.get('__key__')} of {sample.get('__url__')} lacks {missing}; has {sorted(sample)}"
                )
            yield sample
        except Exception as exn:
            if handler(exn):
                continue
            break


def select_samples(samples, selection_url: str):
    """Only the samples the curation selection keeps (``<selection_url>/{shard}.parquet``, written by the
    ``sample_selection`` asset); a tar with no selection file yet gives none."""
    from shardprep.curation.selection import SelectionFiles

    selection = SelectionFiles(selection_url)
    for sample in samples:
        if sample["__key__"] in selection.keys(sample["__url__"].rsplit("/", 1)[-1].removesuffix(".tar")):
            yield sample


_open_tars = wds.filters.pipelinefilter(tar_samples)
_select_samples = wds.filters.pipelinefilter(select_samples)
_split_by_rank = wds.filters.pipelinefilter(split_by_rank)
_split_by_worker = wds.filters.pipelinefilter(split_by_worker)
_shuffle_list = wds.filters.pipelinefilter(shuffle_list)
_shuffle_samples = wds.filters.pipelinefilter(shuffle_samples)
_insert_embeddings = wds.filters.pipelinefilter(insert_embeddings)
_add_empty_embeddings = wds.filters.pipelinefilter(add_empty_embeddings)
_verify_keys = wds.filters.pipelinefilter(verify_keys)


def _pick(new_name, new, old_name, old):
    if new is not None and old is not None:
        raise ValueError(f"pass either {new_name} or its old README name {old_name}, not both")
    return new if new is not None else old


def _check_folder_url(name, value):
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"{name} must be a folder URL (str), got {value!r}; an int here is probably the old "
            "positional index_width/shard_width: pass it by keyword"
        )


class ImageEmbeddingDataset(wds.DataPipeline, wds.compat.FluidInterface):
    """Samples ``(jpg, emb, *extra_keys)`` from webdataset tars plus per-shard embedding folders.

    Same positional parameters as DALLE2-pytorch 1.15.6; keyword-only additions:
    ``embedding_folder_url`` / ``shard_width`` (README names, see module doc), ``shuffle_num``
    (sample shuffle buffer; None/0 = no shuffle), ``rank`` / ``world_size`` (default:
    torch.distributed when initialised, else 0/1), ``seed`` (reproducible shuffles) and
    ``selection_url`` (``<root>/selection``: only the samples the curation rules keep).

    Without ``resample``, shard URLs are dealt to ranks (``rank::world_size``) and then to
    DataLoader workers, so each sample is read once per epoch; a rank keeps the same shards every
    epoch (as DALLE2's ``train_decoder.py`` does) and ``shuffle_shards`` shuffles its own list.
    With ``resample``, every worker draws shards with replacement (webdataset seeds per worker).
    """

    def __init__(
        self,
        urls,
        img_embedding_folder_url=None,
        text_embedding_folder_url=None,
        index_width=None,
        img_preproc=None,
        extra_keys=(),
        handler=wds.handlers.reraise_exception,
        resample=False,
        shuffle_shards=True,
        *,
        embedding_folder_url=None,
        shard_width=None,
        shuffle_num=None,
        rank=None,
        world_size=None,
        seed=None,
        selection_url=None,
    ):
        super().__init__()
        _check_folder_url("text_embedding_folder_url", text_embedding_folder_url)
        img_folder = _pick("img_embedding_folder_url", img_embedding_folder_url, "embedding_folder_url", embedding_folder_url)
        _check_folder_url("img_embedding_folder_url", img_folder)
        if index_width is not None and shard_width is not None:
            raise ValueError("pass index_width (last digits of the key) or shard_width (first digits), not both")
        if resample and shuffle_shards:
            raise ValueError("Cannot both resample and shuffle shards: pass shuffle_shards=False with resample=True")
        self.img_preproc = img_preproc
        self.rank, self.world_size = resolve_rank(rank, world_size)
        keys = ["jpg", "emb", *extra_keys]

        shards = expand_urls(urls)
        folders = {kind: url for kind, url in (("img", img_folder), ("text", text_embedding_folder_url)) if url is not None}
        files = {kind: list_embedding_files(url) for kind, url in folders.items()}
        if files:
            if index_width is None and shard_width is None:
                raise ValueError("reading embeddings from a folder needs index_width (or the README's shard_width)")
            # tars without an embedding file in every folder are skipped, as DALLE2 does
            shards = [url for url in shards if all(shard_id_of_url(url) in by_shard for by_shard in files.values())]
        if not shards:
            raise ValueError(f"no tar shard in {urls!r} has embeddings in {sorted(folders.values())}")
        self.shard_urls = shards

        if resample:
            self.append(wds.ResampledShards(shards))
        else:
            self.append([dict(url=url) for url in shards])  # a list stage: iterated afresh each epoch
            self.append(_split_by_rank(rank=self.rank, world_size=self.world_size))
            self.append(_split_by_worker())
            if shuffle_shards:
                self.append(_shuffle_list(seed=seed, rank=self.rank))
        self.append(_open_tars(handler=handler))
        if selection_url is not None:  # before the embeddings: a dropped sample's row is never read
            self.append(_select_samples(selection_url=selection_url))
        if files:
            self.append(_insert_embeddings(files=files, index_width=index_width, shard_width=shard_width, handler=handler))
        else:
            self.append(_add_empty_embeddings())
        if shuffle_num:
            # before decoding: the buffer holds encoded bytes, and embeddings are already attached
            self.append(_shuffle_samples(bufsize=shuffle_num, seed=seed, rank=self.rank))
        # partial: leave the already attached embedding tensors and `emb` dict alone; only: decode
        # just the members that come out (DALLE2 also parses every .json and .txt it drops)
        wanted = sorted({k for key in keys for k in key.split(";")} - {"emb"})
        self.append(wds.decode("pilrgb", handler=handler, partial=True, only=wanted))
        self.append(_verify_keys(required_keys=keys, handler=handler))
        self.append(wds.map(self.preproc, handler=handler))
        self.append(wds.to_tuple(*keys))

    def preproc(self, sample):
        """Applies ``img_preproc`` to the decoded RGB PIL image."""
        if self.img_preproc is not None:
            sample["jpg"] = self.img_preproc(sample["jpg"])
        return sample


def create_image_embedding_dataloader(
    tar_url,
    num_workers,
    batch_size,
    img_embeddings_url=None,
    text_embeddings_url=None,
    index_width=None,
    shuffle_num=None,
    shuffle_shards=True,
    resample_shards=False,
    img_preproc=None,
    extra_keys=(),
    handler=wds.handlers.reraise_exception,
    *,
    embeddings_url=None,
    shard_width=None,
    rank=None,
    world_size=None,
    seed=None,
    prefetch_factor=2,
    pin_memory=None,
    selection_url=None,
):
    """DALLE2's one-line loader: ``ImageEmbeddingDataset`` in a ``torch.utils.data.DataLoader``.

    ``embeddings_url`` is the README's name for ``img_embeddings_url``; ``prefetch_factor`` is
    passed only when ``num_workers > 0``; ``pin_memory`` defaults to "CUDA is available". Workers
    start with ``start_worker``.
    """
    _check_folder_url("text_embeddings_url", text_embeddings_url)
    dataset = ImageEmbeddingDataset(
        tar_url,
        img_embedding_folder_url=_pick("img_embeddings_url", img_embeddings_url, "embeddings_url", embeddings_url),
        text_embedding_folder_url=text_embeddings_url,
        index_width=index_width,
        shard_width=shard_width,
        shuffle_shards=shuffle_shards,
        resample=resample_shards,
        extra_keys=extra_keys,
        img_preproc=img_preproc,
        handler=handler,
        shuffle_num=shuffle_num,
        rank=rank,
        world_size=world_size,
        seed=seed,
        selection_url=selection_url,
    )
    loader_args = dict(prefetch_factor=prefetch_factor, worker_init_fn=start_worker) if num_workers > 0 else {}
    return DataLoader(
        dataset,
        num_workers=num_workers,
        batch_size=batch_size,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        shuffle=False,
        **loader_args,
    )
