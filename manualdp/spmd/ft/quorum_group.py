"""A process group per quorum: the members' gloo group, re-formed when the membership changes.

A quorum names a group by number (`quorum.group_for`); the members meet in the coordinator's
store under `group/N` (`keys.group`), so that a new group never sees an old one's keys, and connect to each
other as gloo does for `init_process_group`. The member's index in the quorum (sorted by id)
is its rank. They meet on a connection of their own (gloo's rendezvous waits on it, and the
group keeps it), so the manager's connection is never shared with gloo's threads. The price:
torch 2.13's store client now and then takes 5 s to connect (a connect that waits for a
wake-up it missed), once per re-formed group at most.

Why the process's default group, re-made by `destroy_process_group` and `init_process_group`,
and not a `ProcessGroupGloo` built by hand: our collectives (`manualdp.spmd.collectives`) find
a group's ranks and backend through torch's registry of groups (`dist.get_rank(group)`), which
only `init_process_group` and `new_group` fill, and `new_group` needs every rank of the default
group, dead ones included. A process may destroy its default group and make another as often
as it likes; on one machine a re-formed group of 3 is ready in a few milliseconds. The price:
a replica is one process that uses no other default group of its own.

Leaving a group first lets go of what our collectives keep of it (`transport.group.release`: the
next call's header receives, posted early, and the works kept until the next call). Kept, they held
gloo's connections and its network thread past `destroy_process_group` (torch 2.13), until the
interpreter's exit, whose race with that thread aborted a replica after its work was done (exit -6).
"""
from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..transport.group import release
from . import keys

__all__ = ["form_group", "meeting", "drop_group"]


def form_group(store: dist.Store, group: int, rank: int, size: int, timeout: float) -> None:
    """Leave the group this process holds, if any, and join group `group` as `rank` of `size`.

    Every wait of the group (its rendezvous, each send and receive) gives up after `timeout` s.
    """
    drop_group()
    # torch names the default group's rendezvous keys by a counter that destroy_process_group resets to 0 "so that
    # trainers that recover from failure re-create the same names"; an init_process_group that failed (a member gone
    # during the rendezvous) leaves it one up, and the next group's members would wait on different keys
    distributed_c10d._world.group_count = 0
    dist.init_process_group("gloo", store=meeting(store, keys.group(group)), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))


def meeting(store: dist.Store, name: str) -> dist.Store:
    """A connection of its own to `store`, below `name`, where a gloo group's rendezvous meets."""
    # a `SignedStore` meets below a secret-derived prefix, that a stranger cannot compute
    return store.meeting(name) if hasattr(store, "meeting") else dist.PrefixStore(name, store.clone())


def drop_group() -> None:
    """Leave the group this process holds (its peers are not told: see the module's docstring)."""
    if dist.is_initialized():
        release()  # what our collectives keep of it: else gloo's connections outlive it (`transport.group.release`)
        dist.destroy_process_group()
