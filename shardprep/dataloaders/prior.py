"""DALLE2-pytorch's prior loader (embedding-reader over clip-retrieval output), bugs fixed.

Same functions, signatures and batches as ``dalle2_pytorch.dataloaders.prior_loader`` 1.15.6:
text-conditioned batches are ``(img_emb float32[B, D], clip.tokenize(captions, truncate=True))``,
otherwise ``(img_emb float32[B, D], text_emb float32[B, D])``; splits are absolute row ranges in
embedding-reader's global order (files sorted by name). Fixed here:

- ``start > 0``: ``num_data_points`` counts from ``start`` (at most ``count - start`` rows) and
  all three splits are shifted by it (DALLE2 trims only train and ignores ``start`` elsewhere);
  with ``start=0`` the splits are exactly DALLE2's;
- a split smaller than ``world_size`` gives empty slices to the last ranks (DALLE2 asserts);
- a ``PriorEmbeddingDataset`` in a DataLoader with workers deals each worker a contiguous run of
  whole batches, so no row is read twice and batches are those of a single process.
"""

from embedding_reader import EmbeddingReader
from torch import from_numpy
from torch.utils.data import DataLoader, IterableDataset

from .distributed import contiguous_slice, worker_info
from .worker import start_worker


def get_reader(text_conditioned: bool, img_url: str, meta_url: str = None, txt_url: str = None):
    """An ``EmbeddingReader`` (text-conditioned: npy + parquet ``caption`` and ``image_path``, the key a
    curation selection filters on), else a tuple ``(image_reader, text_reader)`` of two npy readers."""
    if img_url is None:
        raise ValueError("get_reader needs img_url, the folder of img_emb_*.npy files")
    if text_conditioned:
        if meta_url is None:
            raise ValueError("get_reader(text_conditioned=True) needs meta_url, the folder of metadata_*.parquet")
        return EmbeddingReader(
            embeddings_folder=img_url,
            file_format="parquet_npy",
            meta_columns=["caption", "image_path"],
            metadata_folder=meta_url,
        )
    if txt_url is None:
        raise ValueError("get_reader(text_conditioned=False) needs txt_url, the folder of text_emb_*.npy files")
    return EmbeddingReader(img_url, file_format="npy"), EmbeddingReader(txt_url, file_format="npy")


class PriorEmbeddingDataset(IterableDataset):
    """Batches of rows ``[start, stop)`` of the reader(s); ``len()`` is the number of rows."""

    def __init__(
        self,
        text_conditioned: bool,
        batch_size: int,
        start: int,
        stop: int,
        image_reader,
        text_reader: EmbeddingReader = None,
        *,
        selection_url: str = None,
    ) -> None:
        super().__init__()
        if selection_url is not None and not text_conditioned:
            raise ValueError("selection_url needs the text-conditioned reader: the keys it filters on come from "
                             "the metadata parquet (get_reader(text_conditioned=True, ...))")
        self.selection_url = selection_url
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not text_conditioned and text_reader is None:
            raise ValueError("PriorEmbeddingDataset(text_conditioned=False) needs text_reader")
        self.text_conditioned = text_conditioned
        self.text_reader = None if text_conditioned else text_reader
        self.image_reader = image_reader
        self.start = int(start)
        self.stop = int(stop)
        self.batch_size = batch_size

    def __len__(self):
        return max(self.stop - self.start, 0)

    def __str__(self):
        return f"<PriorEmbeddingDataset: start: {self.start}, stop: {self.stop}, len: {len(self)}>"

    def __iter__(self):
        worker, num_workers = worker_info()
        # whole batches per worker: same batch boundaries as one process, each row read once
        start, stop = contiguous_slice(self.start, self.stop, worker, num_workers, align=self.batch_size)
        if start >= stop:
            return  # embedding-reader cannot read an empty range
        args = dict(batch_size=self.batch_size, start=start, end=stop, show_progress=False)
        if self.text_conditioned:
            from clip import tokenize  # clip-anytorch; imported here so decoder users skip it

            from shardprep.curation.selection import SelectionFiles

            kept = SelectionFiles(self.selection_url) if self.selection_url is not None else None
            for image_embedding, meta in self.image_reader(**args):
                if kept is not None:  # only the selected rows: a batch may come out shorter
                    rows = [i for i, key in enumerate(meta["image_path"]) if key in kept]
                    if not rows:
                        continue
                    image_embedding, meta = image_embedding[rows], meta.iloc[rows]
                yield from_numpy(image_embedding), tokenize(meta["caption"].to_list(), truncate=True)
        else:
            for (image_embedding, _), (text_embedding, _) in zip(self.image_reader(**args), self.text_reader(**args)):
                yield from_numpy(image_embedding), from_numpy(text_embedding)


def distribute_to_rank(start: int, stop: int, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's contiguous slice of ``[start, stop)`` (DALLE2's arithmetic; may be empty)."""
    return contiguous_slice(start, stop, rank, world_size)


def split_bounds(count: int, num_data_points, train_split: float, eval_split: float, start: int = 0):
    """``[(start, stop)]`` of train, eval and test over a reader of ``count`` rows."""
    if not 0 <= start < count:
        raise ValueError(f"start position {start} must be in [0, reader count {count})")
    if not train_split + eval_split < 1.0:
        raise ValueError(
            f"train_split + eval_split = {train_split + eval_split} leaves no test split (must be < 1)"
        )
    total = min(int(num_data_points), count - start)
    train_stop = start + int(train_split * total)
    eval_stop = train_stop + int(eval_split * total)
    return [(start, train_stop), (train_stop, eval_stop), (eval_stop, start + total)]


def make_splits(
    text_conditioned: bool,
    batch_size: int,
    num_data_points: int,
    train_split: float,
    eval_split: float,
    image_reader: EmbeddingReader,
    text_reader: EmbeddingReader = None,
    start=0,
    rank=0,
    world_size=1,
    *,
    num_workers: int = 0,
    selection_url: str = None,
):
    """``(train, eval, test)`` DataLoaders (``batch_size=None``: the dataset batches) for this rank.
    ``selection_url`` (``<root>/selection``, text-conditioned only): only the samples the curation
    rules keep (splits are still cut by row).

    The test split is what train and eval leave of ``num_data_points`` rows from ``start``.
    ``num_workers`` (keyword, default 0 as in DALLE2) is passed to the DataLoaders.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if not text_conditioned:
        if text_reader is None:
            raise ValueError("make_splits(text_conditioned=False) needs text_reader")
        if text_reader.count != image_reader.count:
            raise ValueError(
                f"image reader has {image_reader.count} rows but text reader has {text_reader.count}: "
                "the embedding folders do not pair up"
            )
    loaders = []
    for split_start, split_stop in split_bounds(image_reader.count, num_data_points, train_split, eval_split, start):
        rank_start, rank_stop = distribute_to_rank(split_start, split_stop, rank, world_size)
        dataset = PriorEmbeddingDataset(
            text_conditioned=text_conditioned,
            batch_size=batch_size,
            start=rank_start,
            stop=rank_stop,
            image_reader=image_reader,
            text_reader=text_reader,
            selection_url=selection_url,
        )
        loaders.append(DataLoader(dataset, batch_size=None, num_workers=num_workers, worker_init_fn=start_worker))
    return tuple(loaders)


__all__ = ["get_reader", "make_splits", "PriorEmbeddingDataset", "distribute_to_rank", "split_bounds"]
