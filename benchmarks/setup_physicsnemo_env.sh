#!/usr/bin/env bash
# A separate environment for benchmarks/domain_vs_shardtensor.py and
# tests/test_physicsnemo_models.py: fastdist (editable, this checkout), nvidia-physicsnemo
# WITHOUT torchvision, and the test runner (pytest, pytest-xdist, hypothesis: tests/conftest.py).
# physicsnemo requires torchvision, whose PyPI wheel cannot load beside the CPU build of torch
# 2.13.0 ("operator torchvision::nms does not exist") and then breaks `import transformers`: it
# must never enter the repository's .venv (CI skips tests/test_physicsnemo_models.py for that).
# physicsnemo is installed with --no-deps, plus only what `physicsnemo.domain_parallel`, its
# layer patches and `physicsnemo.models` import; the benchmark serves torchvision (imported by
# timm at import time, for names the benchmark never uses) as a stub inside the script only.
#
#   benchmarks/setup_physicsnemo_env.sh [ENV_DIR]          # default /tmp/pnvenv
#   /tmp/pnvenv/bin/python benchmarks/domain_vs_shardtensor.py
#   /tmp/pnvenv/bin/python -m pytest -p no:cacheprovider -n 0 tests/test_physicsnemo_models.py
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ENV="${1:-/tmp/pnvenv}"
python3 -m venv "$ENV"
PIP=("$ENV/bin/pip" install -q -c "$ROOT/constraints.txt")
"${PIP[@]}" -e "$ROOT"                          # torch 2.13.0 (CPU), fastdist and its deps
"${PIP[@]}" --no-deps "nvidia-physicsnemo==2.2.2"
# what physicsnemo.domain_parallel, its patches (register_custom_ops) and physicsnemo.models import
"${PIP[@]}" warp-lang packaging requests s3fs tqdm treelib tensordict termcolor jaxtyping \
  nvtx omegaconf
"${PIP[@]}" --no-deps timm                      # timm's own deps would pull torchvision
"${PIP[@]}" pyyaml huggingface_hub safetensors pillow  # timm's deps, less torchvision
# the test runner, at the versions of the repository's .venv (pyproject.toml's addopts use xdist)
"${PIP[@]}" pytest==9.2.0 pytest-xdist==3.8.0 hypothesis==6.170.17
if "$ENV/bin/python" -c "import torchvision" 2>/dev/null; then
  echo "torchvision got installed into $ENV: pip uninstall -y torchvision" >&2
  exit 1
fi
"$ENV/bin/python" -c "
import sys; sys.path.insert(0, '$ROOT/benchmarks')
from domain_vs_shardtensor import import_physicsnemo, physicsnemo_unet
import_physicsnemo(); physicsnemo_unet(); print('physicsnemo.domain_parallel and UNet: ok')"
