"""Who reads what: rank and DataLoader-worker splitting shared by the decoder and prior loaders."""

import math
from itertools import islice

import torch
import torch.distributed
import torch.utils.data


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit ``rank``/``world_size``, else torch.distributed's when initialised, else (0, 1)."""
    if rank is None or world_size is None:
        initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
        if rank is None:
            rank = torch.distributed.get_rank() if initialised else 0
        if world_size is None:
            world_size = torch.distributed.get_world_size() if initialised else 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def worker_info() -> tuple[int, int]:
    """(worker id, number of workers) of the DataLoader worker running this code; (0, 1) in-process."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def split_by_rank(src, rank: int, world_size: int):
    """Every ``world_size``-th item starting at ``rank`` (ranks fixed at construction)."""
    yield from islice(src, rank, None, world_size)


def split_by_worker(src):
    """Every ``num_workers``-th item starting at this worker's id (resolved inside the worker)."""
    worker, num_workers = worker_info()
    yield from islice(src, worker, None, num_workers)


def contiguous_slice(start: int, stop: int, part: int, parts: int, align: int = 1) -> tuple[int, int]:
    """Part ``part`` of ``parts`` of ``[start, stop)``: contiguous, cut on multiples of ``align``.

    Sizes follow DALLE2's ``distribute_to_rank`` (``ceil(n / parts)`` each, the last ones
    shorter) but a part past the end is empty instead of an assertion error.
    """
    units = math.ceil(max(stop - start, 0) / align)
    per_part = math.ceil(units / parts) * align
    part_start = min(start + part * per_part, stop)
    return part_start, min(part_start + per_part, stop)
