"""Serving plumbing (vLLM-shaped): the shared-memory message queue and node locality."""

from fastdist.serving import mq

__all__ = ["mq"]
