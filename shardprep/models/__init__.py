"""The models, each loaded once per process: CLIP through clip-retrieval's loader (``clip``), NeMo's T5,
autoencoders and CLIP text (``nemo``), causal video autoencoders (``video_autoencoders``), and the devices
GPU steps lease (``devices``)."""
