"""A rank of `group_worker.py` whose group is lost as a lane forms: `python -m tests.spmd.ft.lane_loss_worker CONFIG`.

`lost_in_lane` (in CONFIG): the moment is the same, once a rank answered the roll call of a lane of two groups
and published its address in gloo's rendezvous (its peer then connects to a process that is gone); "kill": each
rank SIGKILLs itself then; "term": rank 0 SIGTERMs every rank of its group then, itself last (the group leaves on
purpose, as a job its scheduler stops), wherever its other ranks are.
"""
import json
import os
import signal
import sys

import torch.distributed as dist

from tests.spmd.ft import group_worker


class DyingStore(dist.Store):
    """A store that calls `armed[0]` (the group lost) right after gloo's first write (this rank's address)."""

    def __init__(self, inner: dist.Store, armed: list) -> None:
        super().__init__()
        self.inner, self.armed = inner, armed

    def set(self, key, value):
        if self.armed[0] is None or key.startswith("manualdp"):
            return self.inner.set(key, value)
        self.inner.set(key, highest_port(value))
        self.armed[0]()

    # gloo's rendezvous may call any of these
    def get(self, key): return self.inner.get(key)  # noqa: E704
    def check(self, keys): return self.inner.check(keys)  # noqa: E704
    def wait(self, keys, *timeout): return self.inner.wait(keys, *timeout)  # noqa: E704
    def add(self, key, n): return self.inner.add(key, n)  # noqa: E704
    def set_timeout(self, timeout): return self.inner.set_timeout(timeout)  # noqa: E704
    def compare_set(self, key, expected, desired): return self.inner.compare_set(key, expected, desired)  # noqa: E704
    def delete_key(self, key): return self.inner.delete_key(key)  # noqa: E704
    def multi_get(self, keys): return self.inner.multi_get(keys)  # noqa: E704
    def multi_set(self, keys, values): return self.inner.multi_set(keys, values)  # noqa: E704


def highest_port(address) -> bytes:
    """gloo's address with port 65535: of two ranks, gloo's lower address waits for the other to connect, so the
    peer waits for this rank (which is lost) on every run, not on half of them (ports are drawn by the kernel)."""
    value = address.encode("latin1") if isinstance(address, str) else bytes(address)
    at = value.find(bytes([127, 0, 0, 1]))  # sockaddr_in: family, port (big-endian), 127.0.0.1
    assert at >= 2, value
    return value[:at - 2] + b"\xff\xff" + value[at:]


def lose_in_lane(how: str, pids: list[int]) -> None:
    """Patch the lanes: once this rank answered a roll call of two groups, its group is lost (`how`)."""
    from manualdp.spmd.ft import group_lanes
    roll_call, meeting, armed = group_lanes.Lane._roll_call, group_lanes.meeting, [None]

    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def term() -> None:
        for pid in sorted(pids, key=lambda p: p == os.getpid()):  # the other ranks first, then this one
            os.kill(pid, signal.SIGTERM)

    def then_lost(self, store, number, rank, members):
        roll_call(self, store, number, rank, members)
        if len(members) == 2 and (how == "kill" or self.index == 0):
            armed[0] = kill if how == "kill" else term  # at gloo's first write in this lane's store
    group_lanes.Lane._roll_call = then_lost
    group_lanes.meeting = lambda store, name: DyingStore(meeting(store, name), armed)


def main(config: dict) -> None:
    how = config.pop("lost_in_lane", None)  # None: a plain rank of group_worker's
    if how is None:
        return group_worker.main(config)
    init = dist.init_process_group

    def init_then_patch(*args, **kwargs):  # the group's ranks tell each other their process ids first
        init(*args, **kwargs)
        pids = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        lose_in_lane(how, pids)
    group_worker.dist.init_process_group = init_then_patch
    group_worker.main(config)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # as group_worker's: torch 2.13's gloo threads may abort an interpreter's exit
