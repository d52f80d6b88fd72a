"""A rank that loses a peer which itself stopped on a lost peer names the rank lost first, not only its neighbour."""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from manualdp.spmd.transport.peers import PeerError, talking_to, wait
from manualdp.spmd.transport.postmortem import explain_peer_error, store_key


def _chain(rank, tmp):
    """Rank 2 dies; rank 1 waits on rank 2, rank 0 on rank 1; each writes the line it would print."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=30))
    dist.barrier()
    if rank == 2:
        os._exit(1)  # a machine gone: no message, no clean-up
    peer, buf = rank + 1, torch.zeros(1)
    try:
        with talking_to(peer, 20):
            work = dist.irecv(buf, peer)
        wait(work, peer, 20)
        line = "no error"
    except PeerError as e:
        line = explain_peer_error(e)
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write(line)
    os._exit(0)  # as the CLI: exit without tearing down the broken group; that exit is what rank 0 sees


def test_the_rank_lost_first_is_named_down_the_chain(tmp_path):
    context = mp.start_processes(_chain, args=(str(tmp_path),), nprocs=3, join=False, start_method="spawn")
    deadline = time.monotonic() + 90
    try:
        while any(p.is_alive() for p in context.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    one, zero = ((tmp_path / f"rank{r}.txt").read_text() for r in (1, 0))
    assert one.startswith("rank 1: no answer from rank 2: the connection was closed"), one
    assert "had stopped first" not in one  # rank 2 left no line: it was the one lost
    assert zero.startswith("rank 0: no answer from rank 1: the connection was closed"), zero
    assert "; rank 1 had stopped first: no answer from rank 2: the connection was closed" in zero, zero
    assert "\n" not in zero


class _Store:
    """A dict with the store calls explain_peer_error makes; `dead` raises as a store on a dead machine."""

    def __init__(self, dead=False):
        self.keys, self.dead = {}, dead

    def set_timeout(self, t):
        if self.dead:
            raise RuntimeError("Connection reset by peer")

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]

    def set(self, key, value):
        self.keys[key] = value.encode() if isinstance(value, str) else value


def test_explain_peer_error_without_a_line_from_the_peer_a_dead_store_or_bad_input():
    error = PeerError(3, 5, False, 10.0)
    store = _Store()
    assert explain_peer_error(error, store) == str(error)
    assert store.keys[store_key(3)] == str(error).encode()  # left for the ranks that lose rank 3
    store.keys[store_key(5)] = b"rank 5: step 7: no answer from rank 9 within 10 s (it may have died or hung)"
    assert explain_peer_error(error, store).endswith(
        "; rank 5 had stopped first: step 7: no answer from rank 9 within 10 s (it may have died or hung)")
    assert explain_peer_error(error, _Store(dead=True)) == str(error)
    assert explain_peer_error(PeerError(0, None, True, 1.0)) == str(PeerError(0, None, True, 1.0))  # no group
    with pytest.raises(TypeError, match="error must be a PeerError"):
        explain_peer_error(RuntimeError("x"))
    with pytest.raises(ValueError, match="timeout"):
        explain_peer_error(error, store, timeout=0)
