"""Videos through PyAV: probe and decode with limits and deadlines (``decode``), clips and resampling
(``clips``), re-encoding (``encode``), one video2dataset-layout shard (``shards``), clip counts read back
from a tar (``summary``), a clip's frames evenly spaced for a VLM (``strips``)."""
