"""Curation: aesthetic and NSFW heads on CLIP embeddings (``scores``, ``image_scores``), exact and near
duplicates across shards (``dedup``), the rules that select the samples the training outputs use
(``selection``)."""
