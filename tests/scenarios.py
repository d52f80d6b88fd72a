"""What the multi-process test files share: run every scenario on this rank, in step with the others."""
import traceback

import torch.distributed as dist


def run_scenarios(scenarios: dict) -> dict:
    """{name: fn()} for each scenario; a scenario that raises gives "ERROR <traceback>", and the
    ranks meet after each one, so one failing scenario does not leave the next ones out of step."""
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception:
            out[name] = "ERROR " + traceback.format_exc()
        dist.barrier()
    return out
