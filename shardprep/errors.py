"""The base of every error shardprep raises on purpose: bad config, source, ledger, tar, model, ...

Each error names what is wrong (file, shard, row or field); catching ``ShardprepError`` separates
them from bugs. Every subclass also derives from the builtin it replaces (ValueError, RuntimeError),
so older ``except ValueError`` code keeps working."""


class ShardprepError(Exception):
    """Something shardprep refuses, with a message naming the file, shard, row or field."""
