"""What the test suite's forkserver imports once, before it forks the ranks of gloo tests
(tests/dist_harness.py): the heavy modules most scenarios import, so that no rank re-imports them.

Importing them must not start threads or touch CUDA (a forked child inherits neither safely).
"""

import torch
import torch.distributed
import torch.distributed.checkpoint

import fastdist
import fastdist.checkpoint
import fastdist.nn
import fastdist.testing
import fastdist.train

try:  # the families most gloo scenarios build
    import transformers  # noqa: F401
    from transformers import (  # noqa: F401
        GPT2LMHeadModel,
        LlamaForCausalLM,
        MixtralForCausalLM,
        Qwen3ForCausalLM,
    )
except ImportError:  # the suite skips what needs them
    pass

__all__ = ["fastdist", "torch"]
