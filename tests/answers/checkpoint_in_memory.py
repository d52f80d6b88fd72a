"""A wrong answer to exercise 7.1 (found by the adversary of round 32): keeps the state in a module global and
writes nothing; right in one process, but a new process finds nothing to resume from."""
import copy

import torch

_kept = {}


def save_checkpoint(path, model, optimizer, step):
    _kept.update(model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(optimizer.state_dict()),
                 rng=torch.get_rng_state(), step=step)


def load_checkpoint(path, model, optimizer):
    model.load_state_dict(_kept["model"])
    optimizer.load_state_dict(_kept["opt"])
    torch.set_rng_state(_kept["rng"])
    return _kept["step"]
