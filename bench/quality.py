"""Output checks for the benchmark pairs: a fast run must also be a correct one.

* images: per key, our resized JPEG against img2dataset's (same keys, sizes and statuses are
  required; pixels are compared by PSNR and mean absolute difference in grey levels);
* CLIP: cosine between our image embeddings and clip-retrieval's, per key;
* the fast CLIP preprocess against the exact per-image one on large photo-like images (where the
  DCT-reduced decode applies), run in a driver process (it needs torch).
"""

from __future__ import annotations

import glob
import io
import json
import os
import tarfile

import numpy as np


def _tar_members(path: str) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            if m.isreg():
                key, ext = m.name.split(".", 1)
                out.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return out


def compare_image_outputs(ours_dir: str, theirs_dir: str) -> dict:
    """Pixels and metadata of two img2dataset-layout output folders, key by key."""
    import cv2

    psnr, mad, identical, mismatches = [], [], 0, []
    n = 0
    for their_tar in sorted(glob.glob(os.path.join(theirs_dir, "*.tar"))):
        ours_tar = os.path.join(ours_dir, "images", os.path.basename(their_tar))
        theirs = _tar_members(their_tar)
        ours = _tar_members(ours_tar) if os.path.exists(ours_tar) else {}
        if set(ours) != set(theirs):
            mismatches.append(f"{os.path.basename(their_tar)}: keys differ")
            continue
        for key, t in theirs.items():
            o = ours[key]
            oj, tj = json.loads(o["json"]), json.loads(t["json"])
            for field in ("width", "height", "original_width", "original_height", "status", "sha256"):
                if oj.get(field) != tj.get(field):
                    mismatches.append(f"{key}: {field} {oj.get(field)} != {tj.get(field)}")
            n += 1
            if o["jpg"] == t["jpg"]:
                identical += 1
            a = cv2.imdecode(np.frombuffer(o["jpg"], np.uint8), cv2.IMREAD_UNCHANGED).astype(np.float64)
            b = cv2.imdecode(np.frombuffer(t["jpg"], np.uint8), cv2.IMREAD_UNCHANGED).astype(np.float64)
            if a.shape != b.shape:
                mismatches.append(f"{key}: shape {a.shape} != {b.shape}")
                continue
            mse = float(((a - b) ** 2).mean())
            psnr.append(99.0 if mse == 0 else 10 * np.log10(255.0 ** 2 / mse))
            mad.append(float(np.abs(a - b).mean()))
    return {"images": n, "byte_identical": identical, "mismatches": mismatches[:10], "mismatch_count": len(mismatches),
            "psnr_min": float(min(psnr)) if psnr else None, "psnr_median": float(np.median(psnr)) if psnr else None,
            "mad_max": float(max(mad)) if mad else None, "mad_median": float(np.median(mad)) if mad else None}


def compare_clip_outputs(ours_root: str, theirs_dir: str) -> dict:
    """Cosine of our image/text embeddings and clip-retrieval's, matched by sample key."""
    import pandas as pd

    def by_key(emb_files, meta_files) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for img_f, txt_f, meta_f in zip(*emb_files, meta_files):
            keys = pd.read_parquet(meta_f, columns=["image_path"])["image_path"].tolist()
            img, txt = np.load(img_f).astype(np.float64), np.load(txt_f).astype(np.float64)
            for k, a, b in zip(keys, img, txt):
                out.setdefault(k, (a, b))
        return out

    def files(root: str):
        img = sorted(glob.glob(os.path.join(root, "img_emb", "*.npy")))
        txt = [f.replace("img_emb", "text_emb") for f in img]
        meta = [f.replace("img_emb", "metadata").replace(".npy", ".parquet") for f in img]
        return (img, txt), meta

    ours = by_key(*files(os.path.join(ours_root, "embeddings")))
    theirs = by_key(*files(theirs_dir))
    common = sorted(set(ours) & set(theirs))

    def cos(a, b):
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    ci = [cos(ours[k][0], theirs[k][0]) for k in common]
    ct = [cos(ours[k][1], theirs[k][1]) for k in common]
    return {"keys_ours": len(ours), "keys_theirs": len(theirs), "common": len(common),
            "image_cos_min": min(ci) if ci else None, "image_cos_mean": float(np.mean(ci)) if ci else None,
            "text_cos_min": min(ct) if ct else None}


def clip_fast_vs_exact(model: str, image_files: list[str], tar: str | None = None, tar_images: int = 1000) -> dict:
    """Cosine of fast-preprocess and exact-preprocess image embeddings of the same files; with ``tar``, the
    PSNR of the fast crops of its first ``tar_images`` images (what the pair embeds) against the reference's."""
    from shardprep.models.clip import load_clip_encoder

    enc = load_clip_encoder(model, device="cpu")
    exact = enc.exact()
    datas = [open(f, "rb").read() for f in image_files]
    fast = enc.encode_prepared([enc.prepare_image(d) for d in datas]).astype(np.float64)
    ref = exact.encode_prepared([exact.prepare_image(d) for d in datas]).astype(np.float64)
    cos = (fast * ref).sum(1) / (np.linalg.norm(fast, axis=1) * np.linalg.norm(ref, axis=1))
    from PIL import Image

    # model-independent: the fast crop's pixels against the reference preprocess's (before
    # normalisation), for the images that take the DCT-reduced decode
    spec = enc.image_spec
    reduced, psnr = [], []
    for d, c in zip(datas, cos):
        with Image.open(io.BytesIO(d)) as im:
            if min(im.size) < 4 * spec.resize:
                continue
        reduced.append(c)
        psnr.append(_psnr(d, spec))
    tar_psnr = [_psnr(d, spec) for d in _tar_images(tar, tar_images)] if tar else []
    return {"images": len(datas), "cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
            "reduced_images": len(reduced), "reduced_cos_min": float(min(reduced)) if reduced else None,
            "reduced_psnr_min": float(min(psnr)) if psnr else None,
            "reduced_psnr_median": float(np.median(psnr)) if psnr else None,
            "tar_images": len(tar_psnr), "tar_psnr_min": float(min(tar_psnr)) if tar_psnr else None,
            "tar_psnr_median": float(np.median(tar_psnr)) if tar_psnr else None}


def _tar_images(path: str, n: int) -> list[bytes]:
    from shardprep.tars import iter_members

    out = []
    with open(path, "rb") as f:
        for name, data in iter_members(f, path):
            if name.endswith(".jpg"):
                out.append(data)
                if len(out) == n:
                    break
    return out


def _psnr(data: bytes, spec) -> float:
    """The fast crop of one image against the reference preprocess's pixels, in dB."""
    from PIL import Image

    from shardprep.models.clip import ImageSpec, decode_for_clip

    with Image.open(io.BytesIO(data)) as im:
        ref = _reference_crop(im.convert("RGB"), spec)
    ours = decode_for_clip(data, ImageSpec(spec.resize, spec.crop, (0, 0, 0), (1, 1, 1), spec.round_offsets))
    mse = float(((ours.astype(np.float64) - ref) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def _reference_crop(im, spec) -> np.ndarray:
    """PIL bicubic shortest-edge resize + center crop, as torchvision / Hugging Face do it."""
    from PIL import Image

    w, h = spec.resized_size(*im.size)
    arr = np.asarray(im.resize((w, h), Image.BICUBIC), dtype=np.float64)
    ch, cw = spec.crop
    if spec.round_offsets:
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    else:
        top, left = (h - ch) // 2, (w - cw) // 2
    return arr[top:top + ch, left:left + cw]


def compare_chain_outputs(ours_root: str, glue_dir: str, index_width: int, rows: int) -> dict:
    """The end-to-end pair's reordered image embeddings, shard by shard.

    * faithful: shardprep's ``reorder_array`` applied to the glue's own clip-retrieval output gives the
      glue script's arrays exactly (the script reproduces the algorithm; it only stops after a shard's
      last key, where ours pads to the shard's ``rows`` with zeros);
    * the two sides: the same zero rows (failed samples) and, per sample, the cosine of our embedding and
      the glue's (the tars' pixels differ a little: our ``fast_decode`` resize)."""
    import pandas as pd

    from shardprep.reorder import reorder_array

    meta = pd.concat([pd.read_parquet(p, columns=["image_path"]) for p in
                      sorted(glob.glob(os.path.join(glue_dir, "embeddings", "metadata", "*.parquet")))])
    emb = np.concatenate([np.load(p) for p in
                          sorted(glob.glob(os.path.join(glue_dir, "embeddings", "img_emb", "*.npy")))])
    keys = meta["image_path"].astype(str).to_numpy()
    shard_of = np.array([k[:-index_width] for k in keys])
    mismatches, cos_min, compared, shards = [], 1.0, 0, 0
    for path in sorted(glob.glob(os.path.join(glue_dir, "reordered", "img_emb_*.npy"))):
        shard = os.path.basename(path)[len("img_emb_"):-len(".npy")]
        glue = np.load(path).astype(np.float64)
        n = len(glue)
        pick = shard_of == shard
        faithful = reorder_array(emb[pick], list(keys[pick]), rows, index_width, shard).astype(np.float64)
        if not (np.array_equal(faithful[:n], glue) and not faithful[n:].any()):
            mismatches.append(f"{shard}: reorder script != reorder_array on the same embeddings")
        ours_path = os.path.join(ours_root, "embeddings_reordered", "img", f"img_emb_{shard}.npy")
        if not os.path.exists(ours_path):
            mismatches.append(f"{shard}: no reordered embeddings from shardprep")
            continue
        ours = np.load(ours_path).astype(np.float64)
        live = np.any(glue != 0, axis=1)
        if len(ours) != rows or ours[n:].any() or not np.array_equal(np.any(ours[:n] != 0, axis=1), live):
            mismatches.append(f"{shard}: zero rows differ")
            continue
        a, b = ours[:n][live], glue[live]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        cos_min = min(cos_min, float(cos.min()))
        compared += len(cos)
        shards += 1
    return {"shards": shards, "samples": compared, "cos_min": cos_min, "mismatches": mismatches[:10],
            "mismatch_count": len(mismatches)}
