"""Score heads in their published file formats (state dicts saved from the published architectures, with
random weights) give what the published torch modules give on the same embeddings, read as LAION's
scorers read them (float32, L2-normalised)."""

import numpy as np
import pytest
import torch
from torch import nn

from shardprep.scores import ScoreModelError, load_head


def _aesthetic_v2(relu: bool) -> nn.Module:
    # improved-aesthetic-predictor's MLP (simple_inference.py); its reluMSE sibling has ReLUs
    if relu:
        layers = [nn.Linear(768, 1024), nn.ReLU(), nn.Dropout(0.2), nn.Linear(1024, 128), nn.ReLU(), nn.Dropout(0.2),
                  nn.Linear(128, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 1)]
    else:
        layers = [nn.Linear(768, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2), nn.Linear(128, 64),
                  nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1)]

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def forward(self, x):
            return self.layers(x)

    return MLP()


class _NsfwL14(nn.Module):
    """NeMo Curator's NSFWModel (nemo_curator/models/nsfw.py)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.Module()
        self.norm.register_buffer("mean", torch.rand(768) * 0.01)
        self.norm.register_buffer("variance", torch.rand(768) * 0.01 + 0.001)
        self.linear_1, self.linear_2 = nn.Linear(768, 64), nn.Linear(64, 512)
        self.linear_3, self.linear_4 = nn.Linear(512, 256), nn.Linear(256, 1)

    def forward(self, x):
        x = (x - self.norm.mean) / torch.sqrt(self.norm.variance)
        x = torch.relu(self.linear_1(x))
        x = torch.relu(self.linear_2(x))
        x = torch.relu(self.linear_3(x))
        return torch.sigmoid(self.linear_4(x))


class _NsfwH14(nn.Module):
    """LAION's H14_NSFW_Detector (h14_nsfw_model.py)."""

    def __init__(self):
        super().__init__()
        dims = [1024, 1024, 2048, 1024, 256, 128]
        parts = []
        for a, b in zip(dims, dims[1:]):
            parts += [nn.Linear(a, b), nn.ReLU(), nn.Dropout(0.2)]
        self.layers = nn.Sequential(*parts, nn.Linear(128, 16), nn.Linear(16, 1))

    def forward(self, x):
        return self.layers(x)


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
    if kind == "nsfw_l14":
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
