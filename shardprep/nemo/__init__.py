"""NeMo's training data: text2img balanced tars (``balanced``), ``wdinfo.pkl`` (``wdinfo``), precached Stable
Diffusion encodings (``precache``); diffusion samples of image and video shards (``diffusion``,
``video_diffusion``)."""
