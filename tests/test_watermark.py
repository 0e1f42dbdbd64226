"""LAION's watermark detector read from its published file formats scores what LAION's own recipe gives
(``timm.create_model("efficientnet_b3a")`` + its classifier, ``T.Resize((256, 256))``, ToTensor, Normalize,
softmax index 0), here with random weights; through Dagster, ``pwatermark`` lands in the scores and metadata
parquets and ``watermark_max`` drops the samples above it."""

import io
import warnings
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from shardprep.models.watermark import (
    WatermarkModelError,
    decode_for_watermark,
    load_watermark_model,
    score_watermarks,
)
from tests.fixtures import synthetic
from tests.fixtures.configs import write_config


def _published_detector():
    """LAION's ``inference.py`` model, built as it builds it (not through our loader's code)."""
    import timm
    from torch import nn

    with warnings.catch_warnings():  # timm >= 0.9 maps the old name to efficientnet_b3, with a warning
        warnings.simplefilter("ignore")
        model = timm.create_model("efficientnet_b3a", pretrained=False, num_classes=2)
    model.classifier = nn.Sequential(nn.Linear(in_features=1536, out_features=625), nn.ReLU(), nn.Dropout(p=0.3),
                                     nn.Linear(in_features=625, out_features=256), nn.ReLU(),
                                     nn.Linear(in_features=256, out_features=2))
    return model.eval()


def _reference_preprocess():
    import torchvision.transforms as T

    return T.Compose([T.Resize((256, 256)), T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def _reference(model, images: list[bytes]) -> np.ndarray:
    pre = _reference_preprocess()
    x = torch.stack([pre(Image.open(io.BytesIO(b)).convert("RGB")) for b in images])
    with torch.no_grad():
        return torch.softmax(model(x), dim=1)[:, 0].numpy()


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def detector_files(tmp_path_factory):
    """A random-weight detector whose last layer is set so its scores spread over (0, 1) (random weights
    alone give ~0.5 for every image), saved as LAION's ``.pt`` state dict and as safetensors."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = _published_detector()
    pre = _reference_preprocess()
    calib = torch.stack([pre(synthetic.render_image(100 + i, 96, 96)) for i in range(12)])
    with torch.no_grad():
        h = model.classifier[:5](model.forward_head(model.forward_features(calib), pre_logits=True))
        mu = h.mean(0)
        u = torch.linalg.svd(h - mu, full_matrices=False).Vh[0]  # the direction the images differ most along
        k = 1.0 / ((h - mu) @ u).std()
        model.classifier[5].weight.copy_(torch.stack([k * u, -k * u]))
        model.classifier[5].bias.copy_(torch.stack([-k * u @ mu, k * u @ mu]))
    out = tmp_path_factory.mktemp("watermark")
    torch.save(model.state_dict(), out / "watermark_model_v1.pt")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return model, str(out / "watermark_model_v1.pt"), str(out / "model.safetensors")


def test_scores_are_laions_for_both_file_formats(detector_files, tmp_path):
    import webdataset as wds

    model, pt, safetensors = detector_files
    # small images of several sizes and modes (no DCT scaling applies): exactly the reference's pixels
    small = [_encoded(synthetic.render_image(i, 60 + 37 * i, 200 - 23 * i), "PNG") for i in range(4)]
    small.append(_encoded(synthetic.render_image(9, 120, 90).convert("L"), "PNG"))
    small.append(_encoded(synthetic.render_image(10, 200, 150), "JPEG"))  # < 512: decoded at full size
    want = _reference(model, small)
    assert np.ptp(want) > 0.1  # spread: a wrong index or preprocess would show
    for path in (pt, safetensors):
        detector = load_watermark_model(path, "cpu")
        assert detector.path == path and not detector.model.training
        got = detector(np.stack([decode_for_watermark(b) for b in small]))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert load_watermark_model(pt, "cpu") is load_watermark_model(pt, "cpu")  # loaded once per process

    # a big JPEG is decoded at a reduced DCT scale (>= 256 a side), then resized: close to the full decode
    big = [_encoded(synthetic.render_image(50 + i, 1600 + 300 * i, 1200), "JPEG") for i in range(2)]
    with Image.open(io.BytesIO(big[0])) as im:
        im.draft("RGB", (256, 256))
        assert im.size == (400, 300)  # what decode_for_watermark starts from: 1/4 scale
    np.testing.assert_allclose(load_watermark_model(pt, "cpu")(np.stack([decode_for_watermark(b) for b in big])),
                               _reference(model, big), atol=0.02)

    # a shard tar, batched across batches, with a sample that cannot be decoded and one with no image
    tar = tmp_path / "00000.tar"
    with wds.TarWriter(str(tar)) as sink:
        for i, data in enumerate(small[:3]):
            sink.write({"__key__": f"0000000{i}", "png": data, "txt": "a"})
        sink.write({"__key__": "00000003", "jpg": b"not an image", "txt": "b"})
        sink.write({"__key__": "00000004", "txt": "c"})
        sink.write({"__key__": "00000005", "png": small[3], "txt": "d"})
    keys, scores, skipped, name = score_watermarks(str(tar), load_watermark_model(pt, "cpu"), batch_size=2, threads=2)
    assert keys == [f"0000000{i}" for i in range(6)] and name == pt
    # other batch sizes than the reference's pick other conv kernels: equal to float rounding, not to the bit
    np.testing.assert_allclose(scores[[0, 1, 2, 5]], want[:4], atol=2e-4)
    assert np.isnan(scores[[3, 4]]).all()
    assert [s["key"] for s in skipped] == ["00000003", "00000004"]
    assert "image decode failed: UnidentifiedImageError" in skipped[0]["reason"]
    assert "no image member" in skipped[1]["reason"]


def test_a_file_that_is_not_the_detector_is_refused_naming_it(tmp_path, detector_files):
    from torch import nn

    from shardprep.config import ConfigError, config_from_dict

    torch.save(nn.Linear(512, 1).state_dict(), tmp_path / "aesthetic.pth")
    with pytest.raises(WatermarkModelError, match=r"watermark model .*aesthetic.pth: not LAION's watermark "
                                                  r"detector .*missing .*2 unexpected \['weight', 'bias'\]"):
        load_watermark_model(str(tmp_path / "aesthetic.pth"), "cpu")
    state = detector_files[0].state_dict()
    state["classifier.5.weight"] = torch.zeros(3, 256)  # a 3-class head: the right keys, the wrong shape
    torch.save(state, tmp_path / "three.pt")
    with pytest.raises(WatermarkModelError, match=r"three.pt: not LAION's .*classifier.5.weight.*torch.Size\(\[3, 256\]\)"):
        load_watermark_model(str(tmp_path / "three.pt"), "cpu")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(WatermarkModelError, match="list.pt: holds a list, not a state dict"):
        load_watermark_model(str(tmp_path / "list.pt"), "cpu")
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WatermarkModelError, match="broken.pt: cannot read it"):
        load_watermark_model(str(tmp_path / "broken.pt"), "cpu")
    # at config load: a missing file, and the rule without the model it reads
    base = {"source": "/s/*.parquet", "output_root": "/o"}
    with pytest.raises(ConfigError, match="'watermark_model': watermark model .*missing.pt: no such file"):
        config_from_dict({**base, "watermark_model": str(tmp_path / "missing.pt")})
    with pytest.raises(ConfigError, match="'watermark_max': needs 'watermark_model'"):
        config_from_dict({**base, "watermark_max": 0.5})


def test_pipeline_writes_pwatermark_and_watermark_max_selects(tmp_path, image_site, tiny_clip_dir, detector_files):
    """One shard through Dagster with ``watermark_model``: ``pwatermark`` (LAION's on the tar's images) in
    the scores and metadata parquets and the asset's metadata; then ``watermark_max`` keeps exactly the
    samples at or below it, without scoring again."""
    import yaml

    from shardprep.layout import Layout
    from shardprep.tars import iter_samples
    from shardprep_dagster.orchestration.runner import run_pipeline

    model, pt, _ = detector_files
    src = tmp_path / "source"
    synthetic.make_source_parquets(str(src), image_site[1], n_files=1, rows_per_file=20, n_images=120, seed=5)
    fields = dict(source=f"{src}/*.parquet", output_root=str(tmp_path / "out"), samples_per_shard=20, image_size=32,
                  allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}", enable_nemo_text2img=False,
                  enable_nemo_diffusion=False, watermark_model=pt, batch_size=8)
    layout = Layout(str(tmp_path / "out"))
    home = tmp_path / "home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        assert run_pipeline(write_config(tmp_path / "c.yaml", **fields), instance=instance, progress=False,
                            in_process=True).ok
        scores = pq.read_table(layout.scores("00000")).to_pandas()
        meta = pq.read_table(layout.emb_metadata("00000")).to_pandas()
        assert list(scores["key"]) == list(meta["image_path"]) and len(scores) > 10
        assert set(scores["watermark_model"]) == {pt}
        np.testing.assert_array_equal(meta["pwatermark"].to_numpy(), scores["pwatermark"].to_numpy())
        images = {s["__key__"]: s["jpg"] for s in iter_samples(layout.tar("00000"))}
        want = _reference(model, [images[k] for k in scores["key"]])
        np.testing.assert_allclose(scores["pwatermark"].to_numpy(), want, atol=2e-4)  # batches of 8, not one
        (record,) = instance.fetch_materializations(dg.AssetKey("image_scores"), limit=10).records
        metadata = record.asset_materialization.metadata
        assert "pwatermark_histogram" in metadata
        assert metadata["top_by_pwatermark"].value.startswith("![top by pwatermark of shard 00000](data:image/")
        assert metadata["watermark_skipped"].value == 0 and metadata["watermark_model"].value == pt
        assert 'id="watermark_scores"' in Path(layout.report_html).read_text()  # the report's histogram

        limit = float(np.median(scores["pwatermark"]))
        rules = write_config(tmp_path / "rules.yaml", **{**fields, "watermark_max": limit})
        assert yaml.safe_load(Path(rules).read_text())["watermark_max"] == limit
        assert run_pipeline(rules, instance=instance, progress=False, in_process=True).ok
        assert len(instance.fetch_materializations(dg.AssetKey("image_scores"), limit=10).records) == 1
    selection = pq.read_table(layout.selection("00000")).to_pandas().merge(scores, on="key")
    keep = selection["pwatermark"] <= limit
    assert 0 < keep.sum() < len(selection)
    assert (selection["keep"] == keep).all()
    assert set(selection[~selection["keep"]]["reason"]) == {"watermark_max"}
