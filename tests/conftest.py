import torch
from hypothesis import settings

# Tests run on 2 cores next to multi-process tests; one thread per process keeps them fair.
torch.set_num_threads(1)
settings.register_profile("ci", deadline=None, max_examples=30)
settings.load_profile("ci")
