"""Aesthetic and NSFW scores from CLIP image embeddings, with the published heads in their published files.

Every head reads the embedding as LAION's scorers do: upcast to float32 (clip-retrieval stores float16),
then L2-normalised (``normalized()`` in the aesthetic predictor; the NSFW detectors were trained on
clip-retrieval's normalised ``img_emb``). Heads, recognised by their state-dict keys:

* ``aesthetic_v2``: christophschuhmann/improved-aesthetic-predictor's MLP
  (``sac+logos+ava1-l14-linearMSE.pth``: ``layers.{0,2,4,6,7}``, 768 -> 1024 -> 128 -> 64 -> 16 -> 1
  with no activation: its ReLUs are commented out); ``ava+logos-l14-reluMSE.pth`` (``layers.{0,3,6,9,11}``)
  has a ReLU after each of the first four layers. Scores on a 1-10 rating scale, unbounded.
* ``aesthetic_v1``: LAION-AI/aesthetic-predictor's single ``nn.Linear`` (``weight`` [1, d], ``bias``):
  ``sa_0_4_vit_l_14_linear.pth`` (768) and ``sa_0_4_vit_b_32_linear.pth`` (512).
* ``nsfw_l14``: NeMo Curator's torch port of LAION's Keras L/14 detector (``clip_autokeras_binary_nsfw.pth``:
  ``norm.mean``/``norm.variance``, ``linear_1..4`` 768 -> 64 -> 512 -> 256 -> 1, ReLU, sigmoid):
  a probability, 1 = unsafe (LAION's ``punsafe``).
* ``nsfw_b32``: the same port of LAION's Keras B/32 detector (``clip_autokeras_nsfw_b32``: norm, ``linear_1..3``
  512 -> 32 -> 32 -> 1, ReLU, sigmoid; no port is published: convert the Keras weights to these keys).
* ``nsfw_h14``: LAION's ``H14_NSFW_Detector`` (``h14_nsfw.pth``: ``layers.{0,3,6,9,12,15,16}``, 1024 -> ... -> 1,
  ReLU + dropout between, no sigmoid: its raw output, as clip-retrieval's ``predict`` returns it).

LAION's Keras SavedModel zips need TensorFlow and autokeras; they are refused with the name of the torch
port to use. Files load with ``torch.load(weights_only=True)`` (``.pth``/``.pt``) or safetensors, from a
local path, any fsspec URL, or a hub id ``org/repo`` (its ``model.safetensors``, as NeMo Curator's
``ttj/sac-logos-ava1-l14-linearMSE``) or ``org/repo/file`` read from the local Hugging Face cache.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import pickle
import zipfile
from dataclasses import dataclass

import numpy as np

from shardprep.errors import ShardprepError

KINDS = ("aesthetic_v2", "aesthetic_v1", "nsfw_l14", "nsfw_b32", "nsfw_h14")


def unit_rows(embeddings: np.ndarray) -> np.ndarray:
    """Rows as float32 unit vectors (clip-retrieval stores float16; a zero row stays zero), contiguous."""
    x = np.asarray(embeddings, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.where(norms == 0, 1.0, norms))


class ScoreModelError(ShardprepError, ValueError):
    """A score head's file cannot be read, is not a known head, or does not fit the embeddings."""


@dataclass(frozen=True)
class ScoreHead:
    """One loaded head: ``kind``, the embedding width it reads, and its layers as float32 arrays
    (``(weight [out, in], bias [out])`` each), evaluated with numpy: a few matrix products per batch
    need no torch at scoring time."""

    path: str
    kind: str
    dim: int
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    relu: tuple[bool, ...] = ()  # after layer i
    mean: np.ndarray | None = None  # nsfw_l14's normalisation
    variance: np.ndarray | None = None
    sigmoid: bool = False

    def __call__(self, embeddings: np.ndarray) -> np.ndarray:
        """Scores (float32 [N]) of embeddings ``[N, dim]`` (any float dtype; normalised here)."""
        x = np.asarray(embeddings, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ScoreModelError(f"score head {self.path} ({self.kind}) reads {self.dim}-wide embeddings, got "
                                  f"shape {tuple(x.shape)}: it was trained on another CLIP model's embeddings")
        x = unit_rows(x)
        if self.mean is not None:
            x = (x - self.mean) / np.sqrt(self.variance)
        for i, (w, b) in enumerate(self.layers):
            x = x @ w.T + b
            if i < len(self.relu) and self.relu[i]:
                x = np.maximum(x, 0.0)
        x = x[:, 0]
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32) if self.sigmoid else x.astype(np.float32)


def head_file(spec: str) -> str:
    """A local file holding the head named by ``spec`` (see the module docstring): a local path as it
    is, an fsspec URL copied to a local cache once, a hub id looked up in the Hugging Face cache."""
    from shardprep import storage

    if os.path.exists(spec):
        return spec
    if "://" in spec:
        if not storage.exists(spec):
            raise ScoreModelError(f"score head {spec}: no such file")
        local = os.path.join(_cache_dir(), hashlib.sha256(spec.encode()).hexdigest()[:16] + "-" + spec.rsplit("/", 1)[-1])
        if not os.path.exists(local):  # fetched whole, then renamed: a concurrent reader never sees part
            storage.fetch_file(spec, f"{local}.{os.getpid()}.part")
            os.replace(f"{local}.{os.getpid()}.part", local)
        return local
    parts = spec.split("/")
    if len(parts) in (2, 3) and all(parts) and not spec.startswith((".", "/")):
        from huggingface_hub import try_to_load_from_cache

        repo, name = "/".join(parts[:2]), parts[2] if len(parts) == 3 else "model.safetensors"
        found = try_to_load_from_cache(repo, name)
        if isinstance(found, str):
            return found
        raise ScoreModelError(f"score head {spec}: no such file, and {name} of hub repo {repo} is not in the local "
                              "Hugging Face cache (hubs are not reached at run time: download it first)")
    raise ScoreModelError(f"score head {spec}: no such file (hubs are not reached at run time: download it)")


def _cache_dir() -> str:
    path = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardprep", "score_heads")
    os.makedirs(path, exist_ok=True)
    return path


def _read_state(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".zip"):
        raise ScoreModelError(f"score head {path}: a Keras SavedModel zip (needs TensorFlow and autokeras); use its "
                              "torch port, e.g. NeMo Curator's clip_autokeras_binary_nsfw.pth")
    try:
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            return dict(load_file(path))
        state = _torch_zip_state(path) if zipfile.is_zipfile(path) else _torch_load(path)
    except ScoreModelError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is named with its cause
        raise ScoreModelError(f"score head {path}: cannot read it ({type(e).__name__}: {e})") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ScoreModelError(f"score head {path}: holds a {type(state).__name__}, not a state dict")
    return {k: np.asarray(v, dtype=np.float32) for k, v in state.items() if isinstance(v, np.ndarray)}


def _torch_load(path: str):
    """A legacy (pre-1.6, not zip) torch file: torch itself reads it; tensors become numpy arrays."""
    import torch

    def arrays(obj):
        if isinstance(obj, dict):
            return {k: arrays(v) for k, v in obj.items()}
        return obj.float().numpy() if isinstance(obj, torch.Tensor) else obj

    return arrays(torch.load(path, map_location="cpu", weights_only=True))


# torch's storage types in a checkpoint -> numpy dtypes (bfloat16: its 16 high bits of a float32)
_STORAGE_DTYPES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
                   "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
                   "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


def _torch_zip_state(path: str):
    """A torch >= 1.6 checkpoint (a zip: ``data.pkl`` + one file per storage) read with numpy alone, as
    ``torch.load(weights_only=True)`` reads it: only plain containers and tensors are unpickled. A config
    load that checks a head's kind and width thus never imports torch (seconds of every CLI command)."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        pkl = next(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")
        prefix = pkl[: -len("data.pkl")]
        order = "<" if f"{prefix}byteorder" not in names or z.read(f"{prefix}byteorder") == b"little" else ">"

        def storage(pid):
            _, kind, key, _location, _numel = pid
            dtype = _STORAGE_DTYPES[kind]
            raw = z.read(f"{prefix}data/{key}")
            if dtype == "bfloat16":
                return (np.frombuffer(raw, f"{order}u2").astype(np.uint32) << 16).view(np.float32)
            return np.frombuffer(raw, np.dtype(dtype).newbyteorder(order))

        return _WeightsUnpickler(z.open(pkl), storage).load()


def _rebuild_tensor(storage, offset, size, stride, *_):
    size, stride = tuple(size), tuple(stride)
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                           strides=tuple(s * storage.itemsize for s in stride)).copy()


class _WeightsUnpickler(pickle.Unpickler):
    """The classes a weights-only torch pickle may name, and nothing else."""

    def __init__(self, f, storage) -> None:
        super().__init__(f)
        self._storage = storage

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a weights file")

    def persistent_load(self, pid):
        return self._storage(pid)


def _linear(state: dict[str, np.ndarray], prefix: str) -> tuple[np.ndarray, np.ndarray]:
    return state[f"{prefix}weight"], state[f"{prefix}bias"]


_LOADED: dict[tuple[str, float, int], ScoreHead] = {}


def load_head(spec: str) -> ScoreHead:
    """The head named by ``spec`` (a path, URL or hub id), its kind told by its keys (see the module
    docstring); read once per process and file version (config loads and every shard reuse it)."""
    local = head_file(spec)
    st = os.stat(local)
    cached = _LOADED.get((local, st.st_mtime, st.st_size))
    if cached is None:
        cached = _LOADED[(local, st.st_mtime, st.st_size)] = _load_head(local)
    return cached if cached.path == spec else dataclasses.replace(cached, path=spec)


def _load_head(path: str) -> ScoreHead:
    state = _read_state(path)
    keys = set(state)

    def indices(prefix: str) -> list[int]:
        return sorted({int(k.split(".")[1]) for k in keys if k.startswith(prefix) and k.endswith(".weight")})

    try:
        if keys == {"weight", "bias"}:
            layer = _linear(state, "")
            kind, layers, relu = "aesthetic_v1", (layer,), ()
        elif {"norm.mean", "norm.variance"} <= keys:
            count = sum(1 for k in keys if k.startswith("linear_") and k.endswith(".weight"))  # linear_1..n
            layers = tuple(_linear(state, f"linear_{i}.") for i in range(1, count + 1))
            kind = {4: "nsfw_l14", 3: "nsfw_b32"}.get(count)
            if kind is None:
                raise ScoreModelError(f"score head {path}: a normalised NSFW head with {count} linear layers; known: "
                                      "4 (L/14) or 3 (B/32)")
            head = ScoreHead(path, kind, int(layers[0][0].shape[1]), layers, (True,) * (count - 1) + (False,),
                             state["norm.mean"].reshape(-1), state["norm.variance"].reshape(-1), sigmoid=True)
            return _checked(head)
        elif indices("layers.") in ([0, 2, 4, 6, 7], [0, 3, 6, 9, 11]):
            idx = indices("layers.")
            layers = tuple(_linear(state, f"layers.{i}.") for i in idx)
            kind, relu = "aesthetic_v2", (True, True, True, True) if idx == [0, 3, 6, 9, 11] else ()
        elif indices("layers.") == [0, 3, 6, 9, 12, 15, 16]:
            layers = tuple(_linear(state, f"layers.{i}.") for i in (0, 3, 6, 9, 12, 15, 16))
            kind, relu = "nsfw_h14", (True,) * 5  # after the first five; 128 -> 16 -> 1 have none
        else:
            raise ScoreModelError(f"score head {path}: keys {sorted(keys)[:8]} are none of the known heads ({', '.join(KINDS)})")
    except KeyError as e:
        raise ScoreModelError(f"score head {path}: missing {e} for its kind of head") from None
    return _checked(ScoreHead(path, kind, int(layers[0][0].shape[1]), layers, relu))


def _checked(head: ScoreHead) -> ScoreHead:
    """Each layer feeds the next, the last gives one number."""
    width = head.dim
    for i, (w, b) in enumerate(head.layers):
        if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise ScoreModelError(f"score head {head.path}: layer {i} is {tuple(w.shape)} + {tuple(b.shape)}, after a "
                                  f"{width}-wide input")
        width = w.shape[0]
    if width != 1:
        raise ScoreModelError(f"score head {head.path}: gives {width} numbers, not one score")
    return head
