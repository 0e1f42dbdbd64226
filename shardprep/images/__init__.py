"""Image shards: img2dataset's resizer (``resize``) and one webdataset shard with img2dataset's files
(``shards``)."""
