"""The fault-tolerant room's rules as pure functions, and its refusals that need no replica process (< 1 s).

The processes that exercise them live in bench/test_adversary_ft.py.
"""
import pytest
import torch
from torch import nn

from manualdp.runners.ft_train import parse_address
from manualdp.spmd.ft import Coordinator, FaultTolerantDDP, Manager, Quorum, plan_recovery
from manualdp.spmd.ft.quorum import agreed
from tests.spmd.ft.harness import member


def test_a_quorum_is_provisional_while_a_live_replica_outside_holds_more_of_the_run():
    a, b = (5, 2), (5, 2)
    assert agreed([member("c", synced=False)], {})  # nobody holds the run's state: the first quorum defines it
    assert not agreed([member("c", synced=False)], {"a": a, "b": b})  # a lone joiner beside members in a long step
    assert not agreed([member("c", 5, since=1)], {"a": a})  # left out of round 2, c would fork from step 5
    assert agreed([member("a", 5, since=2)], {"a": a, "c": (5, 1)})  # the holders may leave a slow one out
    assert agreed([member("a", 5, since=2), member("c", 3, since=1)], {"b": (4, 1)})


def test_a_provisional_replica_ahead_in_steps_receives_and_never_sends():
    q = Quorum(9, (member("a", 2, since=2), member("b", 2, since=2), member("c", 3, synced=False)), 9)
    assert q.step == 2 and plan_recovery(q) == {"c": "a"}
    alone = Quorum(9, (member("c", 3, synced=False),), 9, agreed=False)
    assert Quorum.from_json(alone.to_json()) == alone and plan_recovery(alone) == {}


def test_refusals_in_one_line():
    with Coordinator(0) as c:
        for kw, name in (({"heartbeat_interval": 1.0, "heartbeat_timeout": 0.5}, "heartbeat_timeout"),):
            with pytest.raises(ValueError, match=name):
                Manager("r", "127.0.0.1", c.port, **kw)
        with pytest.raises(TypeError, match="host"):
            Manager("r", None, c.port)
        m = Manager("r", "127.0.0.1", c.port, timeout=5)
        try:
            net, other = nn.Linear(2, 2), nn.Linear(2, 2)
            with pytest.raises(ValueError, match="optimizer: its parameter group 0"):
                FaultTolerantDDP(net, torch.optim.SGD(other.parameters(), lr=0.1), m)
            FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), m)  # nothing was registered before
        finally:
            m.close()
    with pytest.raises(ValueError, match="port number"):
        parse_address("127.0.0.1:\u00b2")
