"""The conformance harness: torch's own DDP tests, run from the wheel, pass with manualdp's wrapper too.

The whole selection takes long (`python bench/conformance.py`); here a fast pair of tests
runs both ways, and the selection itself is checked.
"""
import pytest

from manualdp.benchmarks import conformance

SUITE = ["test_DistributedDataParallelCPU", "test_ddp_join_model_equivalence"]


def test_selection_leaves_out_only_tests_that_read_torch_privates_or_cannot_run_on_cpu():
    chosen, left_out = conformance.select()
    assert len(chosen) > 40 and not set(chosen) & set(left_out)
    assert all(why.startswith(("reads torch private", "skips on every CPU-only")) for why in left_out.values())
    assert "test_DistributedDataParallel_SyncBatchNorm" in left_out
    assert "test_ddp_logging_data_cpu" in left_out and "test_ddp_uneven_inputs" in chosen
    assert set(conformance.FAST) <= set(chosen)


def test_first_line_is_the_exception_of_the_traceback():
    text = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nTypeError: bad keyword\nmore'
    assert conformance.first_error_line(text) == "TypeError: bad keyword"


@pytest.mark.parametrize("name", SUITE)
def test_torch_ddp_test_passes_with_manualdp_where_it_passes_with_torch(name):
    control, control_error = conformance.run_one(name, manualdp=False)
    assert control == "pass", control_error
    ours, error = conformance.run_one(name, manualdp=True)
    assert ours == "pass", error
