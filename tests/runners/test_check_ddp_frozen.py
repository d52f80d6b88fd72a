"""The ddp exercise's verdict when an answer forgets the grader model's frozen layer: why, not only where."""
import textwrap

import pytest
import torch.distributed as dist

from manualdp.runners.grader.properties.ddp import Twice, ddp_job

FLAT_FORGETS_THE_FROZEN_LAYER = '''
import torch
import torch.distributed as dist


class DDP:  # rung 2, on one rank here: one flat buffer of every parameter's gradient
    def __init__(self, module):
        self.module = module

    def __call__(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        flat = torch.cat([p.grad.flatten() for p in self.module.parameters()])  # the frozen layer's are None
        dist.all_reduce(flat)
'''


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_flat_rung_that_forgets_the_frozen_layer_is_told_about_the_frozen_layer(one_rank, tmp_path):
    assert not any(p.requires_grad for p in Twice().frozen.parameters())  # what the verdict speaks of
    answer = tmp_path / "my_ddp.py"
    answer.write_text(textwrap.dedent(FLAT_FORGETS_THE_FROZEN_LAYER))
    error = ddp_job(str(answer), steps=1)["error"]
    assert error.startswith("rank 0: AttributeError: 'NoneType' object has no attribute 'flatten' (at ")
    assert "line 14: flat = torch.cat([p.grad.flatten() for p in self.module.parameters()])" in error
    assert "The model has a frozen layer (`frozen`, requires_grad=False" in error
    assert "their .grad is None. Skip parameters that do not require a gradient" in error


def test_an_error_that_is_not_about_none_gets_no_frozen_layer_hint(one_rank, tmp_path):
    answer = tmp_path / "my_ddp.py"
    answer.write_text("class DDP:\n    def __init__(self, module):\n        raise ValueError('mine')\n")
    error = ddp_job(str(answer), steps=1)["error"]
    assert error.startswith("rank 0: ValueError: mine (at ") and "frozen" not in error
