"""Where every artifact lives under the output root (one place, so assets and loaders agree)."""

from dataclasses import dataclass

from shardprep.artifacts import ARTIFACTS


@dataclass(frozen=True)
class Layout:
    root: str

    def _join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    @property
    def ledger(self) -> str:
        return self._join("ledger.json")

    # source_parquet: the rows of one shard, validated, with input columns kept
    def source_parquet(self, shard: str) -> str:
        return self._join("parquet", f"{shard}.parquet")

    # image_shards: img2dataset's webdataset layout
    @property
    def images_dir(self) -> str:
        return self._join("images")

    def tar(self, shard: str) -> str:
        return self._join("images", f"{shard}.tar")

    def shard_parquet(self, shard: str) -> str:
        return self._join("images", f"{shard}.parquet")

    def shard_stats(self, shard: str) -> str:
        return self._join("images", f"{shard}_stats.json")

    # video_shards: video2dataset's webdataset layout
    @property
    def videos_dir(self) -> str:
        return self._join("videos")

    def video_tar(self, shard: str) -> str:
        return self._join("videos", f"{shard}.tar")

    def video_parquet(self, shard: str) -> str:
        return self._join("videos", f"{shard}.parquet")

    def video_stats(self, shard: str) -> str:
        return self._join("videos", f"{shard}_stats.json")

    # clip_embeddings: clip-retrieval's inference layout
    @property
    def embeddings_dir(self) -> str:
        return self._join("embeddings")

    def img_emb(self, shard: str) -> str:
        return self._join("embeddings", "img_emb", f"img_emb_{shard}.npy")

    def text_emb(self, shard: str) -> str:
        return self._join("embeddings", "text_emb", f"text_emb_{shard}.npy")

    def emb_metadata(self, shard: str) -> str:
        return self._join("embeddings", "metadata", f"metadata_{shard}.parquet")

    # reordered_embeddings: one npy per tar, row i = key index i (DALLE2 decoder loader)
    @property
    def reordered_img_dir(self) -> str:
        return self._join("embeddings_reordered", "img")

    @property
    def reordered_text_dir(self) -> str:
        return self._join("embeddings_reordered", "text")

    def reordered_img(self, shard: str) -> str:
        return self._join("embeddings_reordered", "img", f"img_emb_{shard}.npy")

    def reordered_text(self, shard: str) -> str:
        return self._join("embeddings_reordered", "text", f"text_emb_{shard}.npy")

    # image_scores: curation scores per sample, from the embeddings
    @property
    def scores_dir(self) -> str:
        return self._join("scores")

    def scores(self, shard: str) -> str:
        return self._join("scores", f"{shard}.parquet")

    # captions: a vision-language model's caption of every image, beside the original one
    @property
    def captions_dir(self) -> str:
        return self._join("captions")

    def captions(self, shard: str) -> str:
        return self._join("captions", f"{shard}.parquet")

    # training_text: the caption each sample trains with, when synthetic captions take part (train_caption)
    @property
    def training_text_dir(self) -> str:
        return self._join("training_text")

    def training_text(self, shard: str) -> str:
        return self._join("training_text", f"{shard}.parquet")

    # ... and for the DALLE2 prior, clip-retrieval's layout over the same rows as the image embeddings:
    # metadata (image_path, caption = the training caption) and the CLIP text embedding of that caption
    def train_text_metadata(self, shard: str) -> str:
        return self._join("training_text", "metadata", f"metadata_{shard}.parquet")

    def train_text_emb(self, shard: str) -> str:
        return self._join("training_text", "text_emb", f"text_emb_{shard}.npy")

    # duplicates: the dedup index and state (shardprep/curation/dedup.py), keep masks per shard
    @property
    def dedup_dir(self) -> str:
        return self._join("dedup")

    @property
    def dedup_state(self) -> str:
        return self._join("dedup", "state.json")

    @property
    def dedup_index(self) -> str:
        return self._join("dedup", "index.faiss")

    @property
    def dedup_db(self) -> str:
        return self._join("dedup", "dedup.sqlite")

    @property
    def dedup_table(self) -> str:
        return self._join("dedup", "duplicates.parquet")

    @property
    def dedup_shards_dir(self) -> str:
        return self._join("dedup", "shards")

    def dedup_shard(self, shard: str) -> str:
        return self._join("dedup", "shards", f"{shard}.parquet")

    # sample_selection: the samples the training outputs use (shardprep/curation/selection.py)
    @property
    def selection_dir(self) -> str:
        return self._join("selection")

    def selection(self, shard: str) -> str:
        return self._join("selection", f"{shard}.parquet")

    @property
    def selection_state(self) -> str:
        return self._join("selection", "state.json")

    @property
    def selection_summary(self) -> str:
        return self._join("selection", "summary.json")

    # NeMo text2img: equal-size tars (reorganize_tar), wdinfo.pkl, precached encodings
    @property
    def balanced_dir(self) -> str:
        return self._join("balanced")

    def balanced_tar(self, index: int) -> str:
        return self._join("balanced", f"{index:05d}.tar")

    @property
    def balanced_wdinfo(self) -> str:
        return self._join("balanced", "wdinfo.pkl")

    @property
    def precached_dir(self) -> str:
        return self._join("precached")

    def precached_tar(self, index: int) -> str:
        return self._join("precached", f"{index:05d}.tar")

    @property
    def precached_wdinfo(self) -> str:
        return self._join("precached", "wdinfo.pkl")

    # NeMo diffusion: {key}..pth / ..pickle / ..json samples per shard, indexed for Megatron-Energon
    @property
    def diffusion_dir(self) -> str:
        return self._join("diffusion")

    def diffusion_tar(self, shard: str) -> str:
        return self._join("diffusion", f"{shard}.tar")

    # previews and reports: for people, not read by any training tool
    def contact_sheet(self, shard: str) -> str:
        return self._join("previews", f"{shard}.png")

    @property
    def report_html(self) -> str:
        return self._join("report", "index.html")

    def shard_outputs(self, artifact: str, shard: str) -> list[str]:
        """The files a per-shard artifact may write for ``shard`` (its record's ``outputs``; those written
        are recorded in its stamp, so ``verify`` finds one that went missing or changed size)."""
        return [getattr(self, method)(shard) for method in ARTIFACTS[artifact].outputs]

    # takedowns (shardprep.takedown): the lists registered, and an audit record per application
    @property
    def takedowns_dir(self) -> str:
        return self._join(".shardprep", "takedowns")

    @property
    def takedown_lists_dir(self) -> str:
        return self._join(".shardprep", "takedowns", "lists")

    def takedown_list(self, version: str) -> str:
        return self._join(".shardprep", "takedowns", "lists", f"{version}.parquet")

    @property
    def takedown_checked(self) -> str:
        return self._join(".shardprep", "takedowns", "checked.json")

    @property
    def takedown_audit_dir(self) -> str:
        return self._join(".shardprep", "takedowns", "audit")

    # bookkeeping: which version each finished output was made with (shardprep.versions)
    def stamp(self, artifact: str, shard: str) -> str:
        return self._join(".shardprep", "stamps", artifact, f"{shard}.json")

    def stamps_dir(self, artifact: str) -> str:
        return self._join(".shardprep", "stamps", artifact)

    # the state index: every stamp of an artifact in one table, plus a journal of changes not yet folded
    # in (shardprep.state)
    @property
    def state_dir(self) -> str:
        return self._join(".shardprep", "state")

    def state_table(self, artifact: str) -> str:
        return self._join(".shardprep", "state", f"{artifact}.parquet")

    @property
    def state_journal(self) -> str:
        return self._join(".shardprep", "state", "journal")
