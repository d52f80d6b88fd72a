"""The grader of chapter 8's exercise (`manualdp.runners.grader.properties.diloco`, run by `check.check_diloco`): the
solution passes, a wrong one fails."""
import argparse
import pathlib
import time

import pytest
import torch

from manualdp.runners.grader.check import check_diloco
from manualdp.runners.grader.properties.diloco import expected_outer_step
from manualdp.runners.grader.properties import Mismatch
from manualdp.spmd.ft.local_sgd import DiLoCo

SOLUTION = pathlib.Path(__file__).resolve().parents[3] / "book" / "solutions" / "diloco.py"


def args(examples=10):
    return argparse.Namespace(timeout=60, deadline=time.monotonic() + 300, memory=4096, examples=examples)


def test_the_formula_is_what_torchs_nesterov_sgd_does_in_diloco():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g, dtype=torch.float64)
    start = torch.nn.Parameter(theta.clone())
    outer = torch.optim.SGD([start], lr=0.7, momentum=0.9, nesterov=True)  # as DiLoCo builds it
    b = torch.zeros(5, dtype=torch.float64)
    for _ in range(3):
        replicas = [start.detach() + 0.1 * torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3)]
        want, b = expected_outer_step(start.detach().clone(), replicas, b, 0.7, 0.9)
        start.grad = sum(start.detach() - t for t in replicas) / 3
        outer.step()
        torch.testing.assert_close(start.detach(), want, rtol=0, atol=1e-14)
    assert DiLoCo.combine is not None


def test_the_reference_solution_passes_and_a_step_without_momentum_fails(tmp_path):
    assert "Nesterov SGD on the average change" in check_diloco(str(SOLUTION), args())
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def outer_step(theta, replicas, momentum, lr, mu):\n"
                     "    delta = sum(theta - t for t in replicas) / len(replicas)\n"
                     "    return theta - lr * delta, momentum\n")
    with pytest.raises(Mismatch, match="expected new (momentum|theta)"):
        check_diloco(str(wrong), args())
