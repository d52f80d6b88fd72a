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
from manualdp.runners.grader.properties import (Mismatch, allreduce_property, allreduce_sizes_property,
                                                cost_sweep_property, ddp_mismatch, hook_mismatch, schedule_property,
                                                resume_property, split_devices_property, split_property,
                                                split_sizes_property, zero1_property, zero1_sizes_property)
from manualdp.runners.grader.properties.diloco import outer_step_property, outer_step_sizes_property, strategies
from manualdp.schedule import ALGORITHMS
from manualdp.split import split_batch

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


def test_an_allreduce_wrong_only_from_50000_elements_fails_past_a_million():
    wrong = answer("allreduce_small_only").allreduce
    for n, shape in ((1, (10**5,)), (2, (49_999,)), (8, (3, 4))):  # where hypothesis draws, it is right
        allreduce_property(wrong, n, shape, torch.float32, 0)
    with pytest.raises(Mismatch, match=r"on 2 tensors of shape \(1048579,\) and dtype float32: .*; device 0 holds .* "
                                       r"\(element 1048578 of 1048579 is \S+, expected \S+\)"):
        allreduce_sizes_property(wrong)


def test_an_allreduce_that_drops_the_partial_last_2_20_chunk_fails_at_2_20_plus_3():
    wrong = answer("allreduce_drops_partial_chunk").allreduce
    allreduce_property(wrong, 2, (10**6,), torch.float32, 0)  # below one chunk: right
    with pytest.raises(Mismatch, match=r"on 2 tensors of shape \(1048579,\) and dtype float32: .*; device 0 holds .* "
                                       r"\(element 104857\d of 1048579 is "):
        allreduce_sizes_property(wrong)


def test_an_allreduce_that_sums_the_first_8_devices_only_fails_on_16():
    wrong = answer("allreduce_first_8_devices").allreduce
    allreduce_property(wrong, 8, (5,), torch.float32, 0)  # as many devices as hypothesis draws: right
    with pytest.raises(Mismatch, match=r"on 16 tensors of shape \(5,\) and dtype float32, holding .*: expected every "
                                       r"device to hold the sum .*; device 0 holds "):
        allreduce_sizes_property(wrong)


def test_every_algorithm_of_the_library_passes_the_sizes_checked_once():
    for algorithm in sorted(ALGORITHMS):
        allreduce_sizes_property(functools.partial(allreduce, algorithm=algorithm))


def test_an_allreduce_off_by_1e8_relative_fails_in_float64():
    wrong = answer("allreduce_off_by_1e8").allreduce
    allreduce_property(wrong, 3, (4,), torch.float32, 0)  # within float32's tolerance: right there
    with pytest.raises(Mismatch, match=r"dtype float64.*: expected every device to hold the sum \[.*\]; device 0 "):
        allreduce_property(wrong, 3, (4,), torch.float64, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_allreduce_biased_by_4e6_or_4e11_fails_beyond_what_any_order_of_summation_rounds(dtype):
    wrong = answer("allreduce_biased_4e6").allreduce
    orders = (lambda ts: sum(ts), lambda ts: sum(reversed(ts)), lambda ts: torch.stack(ts).double().sum(0).to(dtype),
              lambda ts: sum(ts[i] + ts[i + 1] if i + 1 < len(ts) else ts[i] for i in range(0, len(ts), 2)))
    for n in (1, 2, 3, 8):  # every order of summation passes: forwards, backwards, pairwise, in float64 then rounded
        for order in orders:
            allreduce_property(lambda ts, order=order: [t.copy_(s) for s in [order(ts)] for t in ts], n, (1000,),
                               dtype, n)
    with pytest.raises(Mismatch, match=rf"(?s)on 2 tensors of shape \(1000,\) and dtype {str(dtype)[6:]}: expected "
                                       r"every device to hold the sum .*; device 0 holds "):
        allreduce_property(wrong, 2, (1000,), dtype, 0)


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
    assert status == 1 and re.search(r"shape \(1048579,\) .* \(element 1048578 of 1048579", out), out


def grade_diloco(fn, examples: int = 100) -> None:
    """The diloco check as `manualdp check diloco` runs it, on a function of this process."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(database=None, derandomize=True, deadline=None, max_examples=examples,
              suppress_health_check=list(HealthCheck), phases=[p for p in Phase if p.name != "explain"])
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
    ("diloco_old_buffer", r"expected new buffer .* Yours equals the old momentum buffer returned"),
    # heavy-ball and no momentum at all step alike from a zero buffer: the first failure has a running one
    ("diloco_heavy_ball", r", buffer \[[^\]]*[1-9][^\]]*\]: expected new theta .* Yours equals heavy-ball momentum, "
                          r"theta - lr \* b .*: DiLoCo's outer step is Nesterov"),
    ("diloco_no_momentum", r", buffer \[[^\]]*[1-9][^\]]*\]: expected new theta .* Yours equals SGD without "
                           r"momentum, theta - lr \* delta: DiLoCo's outer step is Nesterov"),
])
def test_a_wrong_outer_step_fails_and_its_slip_is_named(name, told):
    with pytest.raises(Mismatch, match=told):
        grade_diloco(answer(name).outer_step)


def test_an_outer_step_right_on_5_replicas_fails_on_16_even_when_hypothesis_draws_few():
    with pytest.raises(Mismatch, match=r"on 16 replica\(s\) .* the first 5 replicas only, of 16"):
        outer_step_sizes_property(answer("diloco_first_five").outer_step)


def test_a_split_right_on_device_0_only_fails_where_shard_1_lies():
    wrong = answer_at(ROOT / "tests" / "answers" / "split_batch_device0.py").split_batch
    split_property(wrong, 2, 1, 2, torch.float32)  # its slices are right: only where shard 1 lies is wrong
    with pytest.raises(Mismatch, match=r"expected shard 1 on devices\[1\] = meta; X's is on cpu"):
        split_devices_property(wrong, 2, 1, 2, torch.float32)


def test_a_split_wrong_past_1000_rows_fails_at_a_million_told_in_one_line():
    wrong = answer("split_batch_small_only").split_batch
    split_property(wrong, 8, 40, 4, torch.float64)  # the most hypothesis draws: right
    split_sizes_property(split_batch)
    with pytest.raises(Mismatch, match=r"X of shape \(1000001, 1\).*: expected the shards of y to be \[\[0, \.\.\., "
                                       r"333333\] \(333334 rows\), .* got \[\[0, \.\.\., 333333\] \(333334 rows\), "
                                       r"\[333334, \.\.\., 666668\] \(333335 rows\)") as told:
        split_sizes_property(wrong)
    assert len(str(told.value)) < 600, str(told.value)


def test_a_zero1_step_right_on_device_0_only_fails_on_another_device():
    wrong = answer_at(ROOT / "tests" / "answers" / "zero1_gather_to_device0.py").zero1_step
    with pytest.raises(Mismatch, match=r"on 3 devices, .* device [12]'s element \d+ \(in device \d's chunk\) .* not "
                                       r"updated on this device"):
        zero1_property(wrong, 3, 7, 1, 0.1, 0.9, 0)


def test_a_zero1_step_wrong_past_1000_parameters_fails_at_a_million():
    wrong = answer("zero1_small_only").zero1_step
    zero1_property(wrong, 8, 64, 3, 0.1, 0.9, 0)  # the most hypothesis draws: right
    zero1_sizes_property(answer_at(ROOT / "book" / "solutions" / "zero1.py").zero1_step)
    with pytest.raises(Mismatch, match=r"on 3 devices, 1000001 parameters, step 2 of 2: expected device 0's momentum"):
        zero1_sizes_property(wrong)


def test_a_zero1_step_off_by_1e8_relative_fails():
    with pytest.raises(Mismatch, match=r"expected every device's parameters to be plain data parallelism's; device 0's "
                                       r"element \d+ .* is (\S+), expected (?!\1)"):
        zero1_property(answer("zero1_off_by_1e8").zero1_step, 2, 5, 1, 0.1, 0.9, 0)


def test_a_reduce_to_device_0_without_the_broadcast_is_not_an_allreduce():
    with pytest.raises(Mismatch, match=r"schedule\(2\): after its 1 rounds, device 1 holds b0 in chunk 0, expected the "
                                       r"sum of every device's chunk 0, a0\+b0: it misses device 0"):
        schedule_property(answer("schedule_reduce_only").schedule, 2)


def test_a_cost_that_times_device_0_alone_fails_on_a_schedule_where_another_is_busier():
    with pytest.raises(Mismatch, match=r"for \S+\(\d+\): expected \S+ s \(manualdp.cost.cost\), got \S+ s"):
        cost_sweep_property(answer("cost_device0_only").cost)


def rank_results(name: str, world: int, off: dict) -> list[dict]:
    """What the ranks of the ddp or hook check send back, `name`'s equal to torch's but where `off` says: (rank, step)
    -> the relative error of that rank's gradients and parameters at that step (built here, not run)."""
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(3, 2, generator=g, dtype=torch.float64)}
    steps = [{"grads": {"w": torch.randn(3, 2, generator=g, dtype=torch.float64)},
              "params": {"w": torch.randn(3, 2, generator=g, dtype=torch.float64)}} for _ in range(3)]
    return [{"torch": {"start": start, "steps": steps},
             name: {"start": start, "steps": [{k: {"w": v["w"] * (1 + off.get((r, s), 0.0))} for k, v in step.items()}
                                              for s, step in enumerate(steps)]}} for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_a_ddp_right_on_rank_0_only_or_off_by_1e9_is_told_at_the_rank_that_differs(world):
    ddp_mismatch(rank_results("DDP", world, {}), "DDP")
    with pytest.raises(Mismatch, match=rf"DDP on {world} ranks, step 0, rank {world - 1}: the gradients when backward "
                                       r"returned differ from torch's DDP's"):
        ddp_mismatch(rank_results("DDP", world, {(world - 1, 0): 1e-9}), "DDP")


def test_a_hook_right_on_rank_0_only_or_off_by_1e5_is_told_at_the_rank_that_differs():
    hook = "fp16_compress_hook"
    hook_mismatch(rank_results(hook, 2, {(0, 1): 1e-7}), hook)  # float16's rounding in another order: right
    with pytest.raises(Mismatch, match=rf"{hook} on 2 ranks, step 1 \(the step with the loss scaled by 8192\), rank 1"):
        hook_mismatch(rank_results(hook, 2, {(1, 1): 1e-5}), hook)
    with pytest.raises(Mismatch, match=rf"{hook} on 3 ranks, step 0, rank 2"):
        hook_mismatch(rank_results(hook, 3, {(2, 0): 0.05}), hook)


def test_a_resume_one_ulp_off_or_right_after_the_first_step_only_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the run's checkpoint.pt is written
    ulp, first = answer("checkpoint_one_ulp"), answer("checkpoint_first_step_only")
    with pytest.raises(Mismatch, match=r"stopped after step 1, .*: the parameters differ from the uninterrupted run's"):
        resume_property((ulp.save_checkpoint, ulp.load_checkpoint), "sgd", (3, 1), 5, 9)
    resume_property((first.save_checkpoint, first.load_checkpoint), "adam", (3, 1), 5, 9)  # right there
    with pytest.raises(Mismatch, match=r"stopped after step 2, "):
        resume_property((first.save_checkpoint, first.load_checkpoint), "adam", (4, 2), 5, 9)
