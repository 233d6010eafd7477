"""Checked modes: replication tracking and ``spmd`` (shard_map-style) bodies."""
