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
    assert len(chosen) >= 60 and not set(chosen) & set(left_out)
    assert all(why.startswith(("reads torch private", "reads `_get_ddp_logging_data` fields", "skips on every CPU-only",
                               "skips with gloo", "asserts torch's implementation"))
               for why in left_out.values())
    assert set(conformance.IMPLEMENTATION) <= set(left_out)
    # private names read in the helpers a test calls count too, each with why manualdp does not offer it
    assert left_out["test_ddp_logging_data_cpu"].startswith(
        "reads torch private `_set_ddp_runtime_logging_sample_rate`: ")
    # a private API on the DDP class that manualdp supports is no reason to leave a test out
    assert {"test_ddp_ignore_params_arg", "test_ddp_multiple_nested_unused_params_err_ignore_params",
            "test_ddp_remove_autograd_hooks", "test_ddp_buffer_hook_allreduce", "test_ddp_broadcast_buffer_via_hook",
            "test_ddp_comm_hook_logging"} <= set(chosen)
    # ... nor are fields of _get_ddp_logging_data that manualdp keeps (module-level helper verify_ddp_error_logged
    # reads has_error and error; _run_uneven_inputs_test reads join_uneven_inputs); others are named
    assert {"test_ddp_unused_params_rebuild_buckets_exception", "test_ddp_uneven_inputs"} <= set(chosen)
    assert left_out["test_different_graph_across_ranks"] == (
        "reads `_get_ddp_logging_data` fields manualdp does not keep: has_rebuilt_buckets")
    assert "test_DistributedDataParallel_SyncBatchNorm" in left_out
    assert "test_ddp_join_model_equivalence" in chosen
    assert set(conformance.FAST) <= set(chosen)


def test_selection_finds_ddp_tests_by_their_code_and_reads_names_only_in_code():
    chosen, _ = conformance.select()
    # DDP tests whose names do not say so: they build a DistributedDataParallel
    assert {"test_invalid_static_graph", "test_output_unused_in_loss_tuple_module",
            "test_output_unused_in_loss_dict_module",
            "test_post_localSGD_optimizer_parity", "test_post_localSGD_optimizer_parity_grad_is_view",
            "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
            "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
            "test_post_localSGD_optimizer_step_reload", "test_static_graph_multi_forward",
            "test_undefined_grad_parity_unused_parameters"} <= set(chosen)
    # `reducer` only in a comment or a docstring, `_sync_buffers` only inside `forward_sync_buffers`
    assert {"test_accumulate_gradients_no_sync_allreduce_hook",
            "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
            "test_ddp_model_diff_num_params_across_ranks", "test_ddp_broadcast_buffers_deprecation_warning",
            "test_ddp_init_sync_buffers_with_forward_sync_buffers_false",
            "test_ddp_join_respects_forward_sync_buffers_false"} <= set(chosen)


def test_logging_fields_read_are_found_in_code():
    code = ("d = m._get_ddp_logging_data()\nddp_logging_data = d\nx = ddp_logging_data.get('iteration')\n"
            "y = ddp_logging_data['error']\nif 'has_error' not in ddp_logging_data: pass\n"
            "z = m._get_ddp_logging_data().get('rank')")
    assert conformance.logging_fields_read(code) == {"iteration", "error", "has_error", "rank"}


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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "None"], out.stderr[-500:]
