"""Recovery in one process: threads stand for a quorum's members, sending and receiving the state as planned.

The members of `plan_recovery`'s plan pass the state through a real store, the receivers asking
before the sources have written it; a state that `torch.load(weights_only=True)` refuses is
refused on the source, naming the entry, and on a receiver that gets it anyway.
"""
import concurrent.futures
import time

import pytest
import torch

from manualdp.spmd.ft import Quorum, RecoveryError, plan_recovery
from manualdp.spmd.ft.keys import state as state_key, state_sha256
from manualdp.spmd.ft.recovery import check_loadable, forget_state, receive_state, send_state
from tests.spmd.ft.harness import member


def test_every_member_behind_receives_the_state_of_the_source_the_plan_names(store):
    quorum = Quorum(7, (member("a", 5), member("b", 5), member("c", 2), member("d", 0, synced=False)), 7)
    plan = plan_recovery(quorum)
    states = {m.id: {"step": m.step, "model": {"w": torch.full((3,), float(i))}} for i, m in enumerate(quorum.members)}

    def replica(rid):
        s = store()
        if rid in plan.values():
            time.sleep(0.2)  # the receivers are waiting by now
            return send_state(s, quorum.round, rid, states[rid])
        return receive_state(s, quorum.round, plan[rid], timeout=10) if rid in plan else None

    with concurrent.futures.ThreadPoolExecutor(len(quorum.members)) as pool:
        done = dict(zip(quorum.ids, pool.map(replica, quorum.ids)))
    assert plan == {"c": "a", "d": "b"}
    for receiver, source in plan.items():
        got, digest = done[receiver]
        assert digest == done[source] and got["step"] == 5  # the checksum the source wrote, and its step
        assert torch.equal(got["model"]["w"], states[source]["model"]["w"])  # its own state, not another source's
    s = store()
    forget_state(s, quorum.round, "a")
    assert not s.check([state_key(quorum.round, "a")]) and not s.check([state_sha256(quorum.round, "a")])
    assert s.check([state_sha256(quorum.round, "b")])  # b's receivers may still be reading
    with pytest.raises(RecoveryError, match=r"the state of replica 'a' \(round 7\) did not come within 0\.2 s"):
        receive_state(s, quorum.round, "a", 0.2)


class Scheduler:
    """A state the unpickler of torch.load(weights_only=True) refuses: an object of a class of its own."""


def test_a_state_torch_load_refuses_is_refused_on_the_source_naming_it_and_on_a_receiver(store):
    state = {"step": 1, "model": {"w": torch.zeros(2)}, "scheduler": Scheduler()}
    with pytest.raises(RecoveryError, match=r"replica 'a' cannot send its state: 'scheduler' holds what") as info:
        check_loadable(state, "a")
    assert info.value.final  # sending it again would not help
    check_loadable({"step": 1, "model": {"w": torch.zeros(2)}}, "a")  # tensors, numbers, dicts: loadable
    s = store()
    send_state(s, 3, "a", state)  # sent anyway: the receiver says why it cannot load it
    with pytest.raises(RecoveryError, match=r"the state of replica 'a' \(round 3\) cannot be loaded with "
                                            r"weights_only=True: Unsupported global"):
        receive_state(s, 3, "a", 5)
