"""Ready-made `fastdist.nn.parallelize` plans for Hugging Face model families, with families as
data.

A plan is a plain dict (module-name pattern -> styles): print it, copy it, edit it. One entry
point makes one: ``plan(model_or_config, mesh, family=None | "auto" | name, **options)``, also
what ``fastdist.nn.parallelize(model, mesh, plan=None | "auto" | name)`` uses.

One file per concern:

* ``family``: the `Family` record (where a family's modules are, its attention's layout, its
  experts) and `build_plan`, the one function that turns a record and a config into a plan;
* ``dense`` and ``moe``: one row per family (Llama/Mistral/Qwen2, Qwen3, GPT-2, Gemma 1/2/3,
  Phi-3/4, GPT-NeoX, Falcon, StableLM, OLMo/OLMo-2; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  DeepSeek-V2/V3, GPT-OSS);
* ``hooks``: the code a row needs where data cannot say it (DeepSeek's `LatentAttention`, the
  MoE block's `SequenceGather`, Falcon's layouts);
* ``dit``: diffusers' diffusion transformers: context-parallel plans (`wan`, `ltx_video`,
  `sd3`, `flux`, `cogvideox`, `qwen_image`, `flux2`, `hunyuan_video`), each family's record
  (`DitFamily`, with its tensor-parallel `TpSplit`);
* ``dit_tp``: tensor x context parallelism of those DiTs, heads over ``tp`` and tokens over
  ``sp`` (``dit_tp.dit_tp(family, ...)``, ``dit_tp.wan_tp``: the module is imported here under
  its name, its functions are not re-exported);
* ``auto``: the same record read off a model nobody wrote a row for (`AutoPlan`);
* ``registry``: the table by ``config.model_type`` (`TABLE`) and `plan`.

The table of what is tested for each family is in ``docs/models.md``.
"""

from fastdist.nn.plans import dit_tp  # the module (fastdist.nn.plans.dit_tp.wan_tp, dit_tp)
from fastdist.nn.plans.auto import AutoPlan, infer
from fastdist.nn.plans.dit import (
    cogvideox,
    flux,
    flux2,
    hunyuan_video,
    ltx_video,
    qwen_image,
    sd3,
    wan,
)
from fastdist.nn.plans.family import Family, Mlp, Plan, build_plan
from fastdist.nn.plans.hooks import LatentAttention, SequenceGather
from fastdist.nn.plans.registry import TABLE, lookup, plan, table

__all__ = [
    "TABLE",
    "AutoPlan",
    "Family",
    "LatentAttention",
    "Mlp",
    "Plan",
    "SequenceGather",
    "build_plan",
    "cogvideox",
    "dit_tp",
    "flux",
    "flux2",
    "hunyuan_video",
    "infer",
    "lookup",
    "ltx_video",
    "plan",
    "qwen_image",
    "sd3",
    "table",
    "wan",
]
