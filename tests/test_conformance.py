"""The conformance harness: torch's own DDP tests, run from the wheel, pass with manualdp's wrapper too.

The whole selection takes long (`python bench/conformance.py`); here one fast test
runs both ways, and the selection itself is checked.
"""
import os

import pytest

from bench import conformance

# The quickest test that trains DDP against a local model step by step (about 15 s for both runs);
# test_DistributedDataParallelCPU and the join test took a minute together, over the CI budget.
SUITE = ["test_DistributedDataParallelCPU_grad_is_view"]


def test_selection_leaves_out_only_tests_that_read_torch_privates_or_cannot_run_on_cpu():
    chosen, left_out = conformance.select()
    assert len(chosen) >= 40 and not set(chosen) & set(left_out)
    assert all(why.startswith(("reads torch private", "skips on every CPU-only", "skips with gloo",
                               "asserts torch's implementation"))
               for why in left_out.values())
    assert set(conformance.IMPLEMENTATION) <= set(left_out)
    # private names read in the helpers a test calls count too
    assert left_out["test_ddp_buffer_hook_allreduce"] == "reads torch private `_register_buffer_comm_hook`"
    # ... and in torch's module-level helpers (verify_ddp_error_logged reads _get_ddp_logging_data)
    assert left_out["test_ddp_unused_params_rebuild_buckets_exception"] == "reads torch private `_get_ddp_logging_data`"
    # a private API on the DDP class that manualdp supports is no reason to leave a test out
    assert {"test_ddp_ignore_params_arg", "test_ddp_multiple_nested_unused_params_err_ignore_params"} <= set(chosen)
    assert "test_DistributedDataParallel_SyncBatchNorm" in left_out
    assert "test_ddp_logging_data_cpu" in left_out and "test_ddp_join_model_equivalence" in chosen
    # through self._run_uneven_inputs_test, a helper not named _test_*
    assert left_out["test_ddp_uneven_inputs"] == "reads torch private `_get_ddp_logging_data`"
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


def test_importing_the_harness_leaves_the_environment_alone():
    # torch's test module wants WORLD_SIZE at import; one left behind in the test process made
    # every later `manualdp train` subprocess believe it ran under torchrun.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "BACKEND")}
    code = "import os, bench.conformance; print(os.environ.get('WORLD_SIZE'), os.environ.get('BACKEND'))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "None"], out.stderr[-500:]
