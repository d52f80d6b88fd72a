"""Wrong answers that hide where a careless grader does not look (tests/answers/planted/): right on device 0 only,
right at small sizes only, off by a little more than the tolerance, wrong only when a sum overflows. Each property
is called here on the answer's functions (fast); one answer goes through `manualdp check`, to see the sizes it
checks once. A grader planted with a hole (one that reads device 0 only, a loosened tolerance) fails here."""
import functools
import importlib.util
import pathlib
import re

import pytest
import torch

from manualdp.allreduce import allreduce
from manualdp.runners.cli import main
from manualdp.runners.grader.properties import Mismatch, allreduce_property, allreduce_sizes_property
from manualdp.runners.grader.properties.diloco import outer_step_property, outer_step_sizes_property, strategies
from manualdp.schedule import ALGORITHMS

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLANTED = ROOT / "tests" / "answers" / "planted"


def answer_at(path: pathlib.Path):
    """The module of the file at `path`, imported here (its functions called in this process)."""
    spec = importlib.util.spec_from_file_location(f"planted_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer(name: str):
    """The module of the answer `name` (tests/answers/planted/name.py)."""
    return answer_at(PLANTED / f"{name}.py")


def test_an_allreduce_right_on_device_0_only_fails_on_device_1():
    wrong = answer("allreduce_device0_only").allreduce
    with pytest.raises(Mismatch, match=r"on 2 tensors .*: expected every device to hold the sum .*; device 1 holds"):
        allreduce_property(wrong, 2, (3,), torch.float32, 0)


def test_an_allreduce_wrong_only_from_50000_elements_fails_at_a_million():
    wrong = answer("allreduce_small_only").allreduce
    for n, shape in ((1, (10**5,)), (2, (49_999,)), (8, (3, 4))):  # where hypothesis draws, it is right
        allreduce_property(wrong, n, shape, torch.float32, 0)
    with pytest.raises(Mismatch, match=r"on 2 tensors of shape \(1000000,\) and dtype float32: .*; device 0 holds .* "
                                       r"\(element 999999 of 1000000 is \S+, expected \S+\)"):
        allreduce_sizes_property(wrong)


def test_every_algorithm_of_the_library_passes_the_sizes_checked_once():
    for algorithm in sorted(ALGORITHMS):
        allreduce_sizes_property(functools.partial(allreduce, algorithm=algorithm))


def test_an_allreduce_off_by_1e8_relative_fails_in_float64():
    wrong = answer("allreduce_off_by_1e8").allreduce
    allreduce_property(wrong, 3, (4,), torch.float32, 0)  # within float32's tolerance: right there
    with pytest.raises(Mismatch, match=r"dtype float64.*: expected every device to hold the sum \[.*\]; device 0 "):
        allreduce_property(wrong, 3, (4,), torch.float64, 0)


@pytest.mark.parametrize("name, dtype", [("allreduce_saturates", torch.int16), ("allreduce_saturates", torch.int32),
                                         ("allreduce_through_float32", torch.int32)])
def test_an_integer_sum_that_overflows_is_the_sum_wrapped_around(name, dtype):
    wrong = answer(name).allreduce
    allreduce_property(wrong, 2, (5,), dtype, 0)  # small values: right
    with pytest.raises(Mismatch, match=rf"dtype {str(dtype)[6:]}.* \(values over the dtype's whole range: the sum "
                                       rf"wraps around.*\. The sum overflows {str(dtype)[6:]} here: the exercise's "
                                       r"rule, torch.distributed.all_reduce's, is the sum in the tensors' own dtype"):
        allreduce_property(wrong, 8, (5,), dtype, 1, wide=True)
    with pytest.raises(Mismatch):
        allreduce_sizes_property(wrong)


def test_the_wrapped_sum_is_torchs():
    # the rule graded: int16 values whose sum passes 32767 wrap around, as integer addition in the dtype does
    a, b = torch.tensor([30000, -30000], dtype=torch.int16), torch.tensor([30000, -30000], dtype=torch.int16)
    allreduce_property(answer("allreduce_saturates").allreduce, 1, (2,), torch.int16, 0)
    allreduce(held := [a, b])
    assert held[0].tolist() == [60000 - 65536, -60000 + 65536]


def test_an_allreduce_that_rebinds_its_loop_name_is_told_nothing_was_written():
    with pytest.raises(Mismatch, match=r"device 0 holds \S+\. No device's tensor changed: your allreduce wrote into "
                                       r"none of them \(`for t in tensors: t = total` only gives the name t another "
                                       r"tensor\): write into each \(`t.copy_\(total\)`\)$"):
        allreduce_property(answer("allreduce_rebinds_name").allreduce, 2, (), torch.float32, 0)


def test_the_grader_checks_a_million_elements_once(capsys):
    status = main(["check", "allreduce", str(PLANTED / "allreduce_small_only.py"), "--examples", "5"])
    out = " ".join(capsys.readouterr().out.split())
    assert status == 1 and re.search(r"shape \(1000000,\) .* \(element 999999 of 1000000", out), out


def grade_diloco(fn, examples: int = 100) -> None:
    """The diloco check as `manualdp check diloco` runs it, on a function of this process."""
    from hypothesis import HealthCheck, given, settings

    @settings(database=None, derandomize=True, deadline=None, max_examples=examples,
              suppress_health_check=list(HealthCheck))
    @given(**strategies())
    def drawn(inputs, lr, mu):
        outer_step_property(fn, *inputs, lr, mu)

    drawn()
    outer_step_sizes_property(fn)


def test_the_reference_outer_step_passes():
    grade_diloco(answer_at(ROOT / "book" / "solutions" / "diloco.py").outer_step, 30)


@pytest.mark.parametrize("name, told", [
    ("diloco_first_five", r"on (\d+) replica\(s\) .* Yours equals the average of the first 5 replicas only, of \1"),
    ("diloco_off_by_1e6", r"expected new theta (\[.*\]), got (?!\1)\["),
    ("diloco_old_buffer", r"expected new momentum .* Yours equals the old momentum buffer returned"),
    # heavy-ball and no momentum at all step alike from a zero buffer: the first failure has a running one
    ("diloco_heavy_ball", r", momentum \[[^\]]*[1-9][^\]]*\]: expected new theta .* Yours equals heavy-ball momentum, "
                          r"theta - lr \* b .*: DiLoCo's outer step is Nesterov"),
    ("diloco_no_momentum", r", momentum \[[^\]]*[1-9][^\]]*\]: expected new theta .* Yours equals SGD without "
                           r"momentum, theta - lr \* delta: DiLoCo's outer step is Nesterov"),
])
def test_a_wrong_outer_step_fails_and_its_slip_is_named(name, told):
    with pytest.raises(Mismatch, match=told):
        grade_diloco(answer(name).outer_step)


def test_an_outer_step_right_on_5_replicas_fails_on_16_even_when_hypothesis_draws_few():
    with pytest.raises(Mismatch, match=r"on 16 replica\(s\) .* the first 5 replicas only, of 16"):
        outer_step_sizes_property(answer("diloco_first_five").outer_step)
