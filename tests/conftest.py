import os

import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the suite well inside its time budget on 2 cores; "dev" explores more.
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)  # simulated ranks are tiny tensors; threads only add overhead
