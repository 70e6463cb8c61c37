import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray >= 2.59 turns token auth on for local clusters

import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
