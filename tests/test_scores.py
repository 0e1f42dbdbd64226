"""Score heads in their published file formats (state dicts saved from the published architectures, with
random weights) give what the published torch modules give on the same embeddings, read as LAION's
scorers read them (float32, L2-normalised)."""

import numpy as np
import pytest
import torch
from torch import nn

from shardprep.curation.scores import ScoreModelError, load_head
from tests.fixtures.score_heads import NsfwB32 as _NsfwB32
from tests.fixtures.score_heads import NsfwH14 as _NsfwH14
from tests.fixtures.score_heads import NsfwL14 as _NsfwL14
from tests.fixtures.score_heads import aesthetic_v2 as _aesthetic_v2


def _embeddings(n: int, d: int) -> np.ndarray:
    # as clip-retrieval stores them: L2-normalised, float16; a few unnormalised and a zero row too
    e = np.random.default_rng(0).normal(size=(n, d)).astype(np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    e[1] *= 3.0
    return e.astype(np.float16)


def _reference(module: nn.Module, emb: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(emb.astype(np.float32))
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    with torch.no_grad():
        return module.eval()(x)[:, 0].numpy()


@pytest.mark.parametrize("name, make, dim, kind", [
    ("sac+logos+ava1-l14-linearMSE.pth", lambda: _aesthetic_v2(relu=False), 768, "aesthetic_v2"),
    ("ava+logos-l14-reluMSE.pth", lambda: _aesthetic_v2(relu=True), 768, "aesthetic_v2"),
    ("sa_0_4_vit_b_32_linear.pth", lambda: nn.Linear(512, 1), 512, "aesthetic_v1"),
    ("sa_0_4_vit_l_14_linear.pth", lambda: nn.Linear(768, 1), 768, "aesthetic_v1"),
    ("clip_autokeras_binary_nsfw.pth", _NsfwL14, 768, "nsfw_l14"),
    ("clip_autokeras_nsfw_b32.pth", _NsfwB32, 512, "nsfw_b32"),
    ("h14_nsfw.pth", _NsfwH14, 1024, "nsfw_h14"),
])
def test_heads_score_like_the_published_modules(tmp_path, name, make, dim, kind):
    torch.manual_seed(0)
    module = make()
    torch.save(module.state_dict(), tmp_path / name)
    head = load_head(str(tmp_path / name))
    assert (head.kind, head.dim) == (kind, dim)
    emb = _embeddings(64, dim)
    got, want = head(emb), _reference(module, emb)
    assert got.dtype == np.float32 and got.shape == (64,)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # read normalised: the row stored 3x too long scores as its unit vector does
    np.testing.assert_allclose(head(emb[1:2].astype(np.float32) / 3), got[1:2], rtol=1e-3, atol=1e-4)
    if kind in ("nsfw_l14", "nsfw_b32"):
        assert ((got > 0) & (got < 1)).all()  # a probability


def test_safetensors_and_wrong_inputs(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    module = _aesthetic_v2(relu=False)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(tmp_path / "model.safetensors"))
    head = load_head(str(tmp_path / "model.safetensors"))  # NeMo Curator's copy of the V2 head
    emb = _embeddings(8, 768)
    np.testing.assert_allclose(head(emb), _reference(module, emb), rtol=1e-4, atol=1e-5)
    # an L/14 head on B/32 embeddings is refused, naming the file
    with pytest.raises(ScoreModelError, match="model.safetensors .* reads 768-wide embeddings, got shape \\(8, 512\\)"):
        head(_embeddings(8, 512))
    import zipfile

    with zipfile.ZipFile(tmp_path / "clip_autokeras_nsfw_b32.zip", "w") as z:
        z.writestr("clip_autokeras_nsfw_b32/saved_model.pb", b"")
    with pytest.raises(ScoreModelError, match="Keras SavedModel zip"):
        load_head(str(tmp_path / "clip_autokeras_nsfw_b32.zip"))
    torch.save({"encoder.weight": torch.zeros(3, 3)}, tmp_path / "other.pth")
    with pytest.raises(ScoreModelError, match="none of the known heads"):
        load_head(str(tmp_path / "other.pth"))
    (tmp_path / "broken.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ScoreModelError, match="broken.pth: cannot read it"):
        load_head(str(tmp_path / "broken.pth"))


def _config(tmp_path, **fields):
    from shardprep.config import config_from_dict

    return config_from_dict({"source": str(tmp_path / "src.parquet"), "output_root": str(tmp_path / "out"), **fields},
                            origin="my.yaml")


def test_a_head_that_does_not_fit_the_clip_model_is_refused_at_config_load(tmp_path, tiny_clip_dir):
    from shardprep.config import ConfigError
    from shardprep.models.clip import embedding_width

    torch.save(_aesthetic_v2(relu=False).state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    torch.save(nn.Linear(512, 1).state_dict(), tmp_path / "sa_0_4_vit_b_32_linear.pth")
    torch.save(_NsfwL14().state_dict(), tmp_path / "clip_autokeras_binary_nsfw.pth")
    l14, b32, nsfw = (str(tmp_path / n) for n in ("sac+logos+ava1-l14-linearMSE.pth", "sa_0_4_vit_b_32_linear.pth",
                                                   "clip_autokeras_binary_nsfw.pth"))
    # the widths come from the model's name or its config.json, never its weights
    assert (embedding_width("ViT-L/14"), embedding_width("ViT-B/32"), embedding_width(f"hf_clip:{tiny_clip_dir}")) \
        == (768, 512, 32)
    assert embedding_width("open_clip:ViT-H-14/laion2b_s32b_b79k") in (1024, None)  # None: open_clip not installed
    cfg = _config(tmp_path, clip_model="ViT-L/14", aesthetic_model=l14, nsfw_model=nsfw)
    assert cfg.aesthetic_model == l14
    assert _config(tmp_path, clip_model="ViT-B/32", aesthetic_model=b32).aesthetic_model == b32
    with pytest.raises(ConfigError) as e:  # an L/14 head on B/32 embeddings, both fields at once
        _config(tmp_path, clip_model="ViT-B/32", aesthetic_model=l14, nsfw_model=nsfw)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and all(line.startswith("my.yaml: config field '") for line in lines)
    assert "'aesthetic_model': " + l14 + " (aesthetic_v2) reads 768-wide embeddings, but clip_model 'ViT-B/32' " \
        "makes 512-wide ones" in lines[0]
    with pytest.raises(ConfigError, match="'aesthetic_model': .* reads 768-wide .* makes 32-wide"):
        _config(tmp_path, clip_model=f"hf_clip:{tiny_clip_dir}", aesthetic_model=l14)
    with pytest.raises(ConfigError, match="'aesthetic_model': .*clip_autokeras_binary_nsfw.pth is a nsfw_l14 head; "
                                          "allowed: aesthetic_v2, aesthetic_v1"):
        _config(tmp_path, clip_model="ViT-L/14", aesthetic_model=nsfw)
    with pytest.raises(ConfigError, match="'nsfw_model': score head .*missing.pth: no such file"):
        _config(tmp_path, nsfw_model=str(tmp_path / "missing.pth"))


def test_heads_load_from_a_hub_id_in_the_local_cache_and_from_urls(tmp_path, monkeypatch):
    """``org/repo`` (NeMo Curator's ttj/sac-logos-ava1-l14-linearMSE: its model.safetensors) from the Hugging
    Face cache laid out as huggingface_hub writes it; a file on any fsspec URL; a hub id not cached is named."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    module = _aesthetic_v2(relu=False)
    cache = tmp_path / "hub"
    snapshot = cache / "models--ttj--sac-logos-ava1-l14-linearMSE" / "snapshots" / "1e77fa0"
    snapshot.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(snapshot / "model.safetensors"))
    (cache / "models--ttj--sac-logos-ava1-l14-linearMSE" / "refs").mkdir()
    (cache / "models--ttj--sac-logos-ava1-l14-linearMSE" / "refs" / "main").write_text("1e77fa0")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    emb = _embeddings(8, 768)
    head = load_head("ttj/sac-logos-ava1-l14-linearMSE")
    assert head.kind == "aesthetic_v2" and head.path == "ttj/sac-logos-ava1-l14-linearMSE"
    np.testing.assert_allclose(head(emb), _reference(module, emb), rtol=1e-4, atol=1e-5)
    with pytest.raises(ScoreModelError, match="model.safetensors of hub repo other/repo is not in the local"):
        load_head("other/repo")
    # a URL (memory:// here; s3:// alike): fetched once into the local cache
    import fsspec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with fsspec.open("memory://heads/sa_0_4_vit_b_32_linear.pth", "wb") as f:
        linear = nn.Linear(512, 1)
        torch.save(linear.state_dict(), f)
    head = load_head("memory://heads/sa_0_4_vit_b_32_linear.pth")
    assert head.kind == "aesthetic_v1" and head.path == "memory://heads/sa_0_4_vit_b_32_linear.pth"
    np.testing.assert_allclose(head(_embeddings(4, 512)), _reference(linear, _embeddings(4, 512)), rtol=1e-4, atol=1e-5)


def test_a_config_with_pth_heads_loads_without_torch(tmp_path, tiny_clip_dir):
    """Checking a head's kind and width reads the weights file with numpy alone: no CLI command that loads
    the config pays for importing torch (seconds), and the weights are the ones torch reads."""
    import subprocess
    import sys

    from shardprep.curation.scores import _read_state
    from tests.fixtures.configs import CHECKOUT
    from tests.fixtures.score_heads import build_tiny_score_heads

    heads = build_tiny_score_heads(str(tmp_path / "heads"), dim=32)
    for path in heads.values():
        ours = _read_state(path)
        theirs = {k: v.float().numpy() for k, v in torch.load(path, weights_only=True).items()}
        assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    code = ("import sys\nfrom shardprep.config import config_from_dict\n"
            f"cfg = config_from_dict({{'source': '/s/*.parquet', 'output_root': '/o', 'clip_model': "
            f"'hf_clip:{tiny_clip_dir}', 'aesthetic_model': {heads['aesthetic']!r}, 'nsfw_model': {heads['nsfw']!r}}})\n"
            "print(cfg.aesthetic_model, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=CHECKOUT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "[]" and heads["aesthetic"] in out.stdout, out
