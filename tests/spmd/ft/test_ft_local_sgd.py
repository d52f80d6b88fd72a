"""Local SGD and DiLoCo on 2 replica processes, against their formulas computed here in one process."""
import pytest
import torch

from manualdp.cost import bytes_per_step
from tests.spmd.ft.harness import guard_bytes, reference_ddp, replicas
from tests.spmd.ft.replica import build, flat_params, make_optimizer, my_shard

pytestmark = pytest.mark.soak  # replica processes: about a minute


def check_bytes(result, rank, method, sync_every):
    """What each block's allreduce sent, measured on the group, against the cost model's bytes per step."""
    nbytes = sum(p.numel() for p in build(0).parameters()) * 8  # float64
    per_step = bytes_per_step(method, nbytes, 2, sync_every, "ring", element_size=8)[rank]
    guard = guard_bytes(2) / sync_every  # the contribution guard's norms, once an average
    assert [r["sent"] / sync_every for r in result["records"]] == [per_step + guard] * len(result["records"])
    assert per_step == 2 * (2 - 1) / 2 * nbytes / sync_every  # ring: 2(n-1)/n of the buffer, once per H steps


def run_two(tmp_path, **config):
    with replicas(tmp_path) as run:
        for i, rid in enumerate("ab"):
            run.start(id=rid, index=i, **config)
        results = run.finish()
    a, b = results["a"][0], results["b"][0]
    assert all(r["committed"] and r["members"] == ["a", "b"] for r in a["records"] + b["records"])
    for ra, rb in zip(a["records"], b["records"], strict=True):
        assert ra["sha256"] == rb["sha256"]  # bitwise the same after every outer step
    return a, b


def test_diloco_outer_step_is_nesterov_sgd_on_the_average_change(tmp_path):
    H, outer, eta, mu = 2, 3, 0.7, 0.9
    config = {"lr": 0.1, "momentum": 0.5}
    a, b = run_two(tmp_path, mode="diloco", sync_every=H, outer_lr=eta, outer_momentum=mu, steps=outer, **config)
    check_bytes(a, 0, "diloco", H)
    check_bytes(b, 1, "diloco", H)
    # the formula, by hand: two replicas from a's model, each with its own inner SGD
    models = [build(0), build(0)]
    inner = [make_optimizer(m.parameters(), config) for m in models]
    theta, momentum = flat_params(models[0]), None
    for k in range(outer):
        for i, (m, opt) in enumerate(zip(models, inner)):
            for j in range(H):
                opt.zero_grad()
                X, y = my_shard(k * H + j, i)
                ((m(X) - y) ** 2).mean().backward()
                opt.step()
        delta = sum(theta - flat_params(m) for m in models) / len(models)  # the average change: the outer gradient
        momentum = delta if momentum is None else mu * momentum + delta
        theta = theta - eta * (delta + mu * momentum)  # Nesterov
        for m in models:
            torch.nn.utils.vector_to_parameters(theta.clone(), m.parameters())
        torch.testing.assert_close(torch.tensor(a["records"][k]["params"], dtype=torch.float64), theta,
                                   rtol=0, atol=1e-12)


def test_local_sgd_with_one_step_per_sync_is_ddp(tmp_path):
    # plain SGD: the average of theta - lr * g_i is theta - lr * (the average of g_i), to rounding
    steps = 4
    a, b = run_two(tmp_path, mode="local_sgd", sync_every=1, steps=steps, lr=0.1, momentum=0.0)
    check_bytes(a, 0, "local_sgd", 1)
    check_bytes(b, 1, "ddp", 1)  # with H = 1, local SGD sends what DDP sends
    members = {s: {"members": ["a", "b"]} for s in range(steps)}
    for s in range(steps):
        expected = reference_ddp({t: members[t] for t in range(s + 1)}, seed=0, config={"momentum": 0.0})
        torch.testing.assert_close(torch.tensor(a["records"][s]["params"], dtype=torch.float64), expected,
                                   rtol=0, atol=1e-12)
