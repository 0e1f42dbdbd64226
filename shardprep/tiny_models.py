"""A tiny random-weight CLIP saved as a local Hugging Face model folder.

Used by the demo and the tests: it loads offline through clip-retrieval's spec ``hf_clip:<dir>``
(``all_clip.load_clip``), whose text side uses OpenAI's ``clip.tokenize`` (77 tokens, vocab 49408),
so the text tower keeps CLIP's vocabulary and context length while everything else is small.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile

STAMP = "shardprep_tiny_clip.json"
SEED = 1234
# OpenAI CLIP's normalisation constants, as in the real checkpoints' preprocessor_config.json
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
VOCAB_SIZE = 49408
CONTEXT_LENGTH = 77
_FILES = ("config.json", "model.safetensors", "preprocessor_config.json", "vocab.json", "merges.txt",
          "tokenizer_config.json")


def _openai_bpe_files(out_dir: str) -> None:
    """vocab.json + merges.txt derived from clip-anytorch's bundled BPE, exactly as OpenAI's SimpleTokenizer."""
    from clip.simple_tokenizer import bytes_to_unicode, default_bpe

    with gzip.open(default_bpe()) as f:
        lines = f.read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == VOCAB_SIZE, len(vocab)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({tok: i for i, tok in enumerate(vocab)}, f, ensure_ascii=False)
    # HF's CLIPTokenizer skips the first line (a version header), like SimpleTokenizer does.
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")


def _params(image_size: int, embed_dim: int) -> dict:
    return {"image_size": image_size, "embed_dim": embed_dim, "seed": SEED, "version": 1}


def _is_complete(out_dir: str, params: dict, files: tuple[str, ...], stamp: str) -> bool:
    try:
        with open(os.path.join(out_dir, stamp)) as f:
            if json.load(f) != params:
                return False
    except (OSError, ValueError):
        return False
    return all(os.path.exists(os.path.join(out_dir, name)) for name in files)


def build_once(out_dir: str, params: dict, files: tuple[str, ...], make, stamp: str = STAMP) -> str:
    """Run ``make(tmp_dir)`` and move its files into ``out_dir``, unless a complete folder built with the
    same ``params`` is there. The files are built in a temp folder beside ``out_dir`` and moved in, the
    stamp last, so an interrupted build is never mistaken for a complete one."""
    out_dir = os.path.abspath(out_dir)
    if _is_complete(out_dir, params, files, stamp):
        return out_dir
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        make(tmp)
        missing = [n for n in files if not os.path.exists(os.path.join(tmp, n))]
        if missing:
            raise RuntimeError(f"building a model in {out_dir}: files {missing} were not written")
        with open(os.path.join(tmp, stamp), "w") as f:
            json.dump(params, f)
        os.makedirs(out_dir, exist_ok=True)
        if os.path.exists(os.path.join(out_dir, stamp)):
            os.remove(os.path.join(out_dir, stamp))
        for name in sorted(os.listdir(tmp), key=lambda n: n == stamp):  # stamp last
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def build_tiny_clip(out_dir: str, image_size: int = 32, embed_dim: int = 32) -> str:
    """Build (once) a seeded tiny ``CLIPModel`` + tokenizer + image processor in ``out_dir``; returns it."""
    if image_size < 8 or image_size % 8:
        raise ValueError(f"build_tiny_clip: image_size must be a multiple of 8 (patch size), got {image_size}")
    if embed_dim < 1:
        raise ValueError(f"build_tiny_clip: embed_dim must be >= 1, got {embed_dim}")

    def make(tmp: str) -> None:
        import torch
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizerFast

        config = CLIPConfig(
            text_config={
                "vocab_size": VOCAB_SIZE,
                "max_position_embeddings": CONTEXT_LENGTH,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                # clip.tokenize: SOT 49406, EOT 49407, zero padding; pooling reads the first EOT
                "bos_token_id": 49406,
                "eos_token_id": 49407,
                "pad_token_id": 0,
            },
            vision_config={
                "image_size": image_size,
                "patch_size": 8,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
            },
            projection_dim=embed_dim,
        )
        # fork_rng: seed the weights without disturbing the caller's global RNG state
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = CLIPModel(config).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        _openai_bpe_files(tmp)
        # the fast tokenizer also saves tokenizer.json, so loading never re-converts the BPE
        tokenizer = CLIPTokenizerFast.from_pretrained(tmp, model_max_length=CONTEXT_LENGTH)
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
            image_mean=CLIP_MEAN,
            image_std=CLIP_STD,
        )
        CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(tmp)

    return build_once(out_dir, _params(image_size, embed_dim), _FILES, make)
