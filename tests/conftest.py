import os

import torch

pytest_plugins = ["pytester"]

# The test models are tiny: intra-op threads buy nothing, and on a busy machine spinning
# OpenMP threads make the suite several times slower. CONVCHECK_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("CONVCHECK_TEST_THREADS", "1")))
