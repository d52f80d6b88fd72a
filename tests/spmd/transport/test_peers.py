"""A peer that dies while this rank is still computing: the next *post* (not a wait) sees it."""
import datetime
import multiprocessing as mp
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class _DieOrDawdle(nn.CrossEntropyLoss):
    """On its 3rd call rank 1 exits, and rank 0 sleeps: rank 0's next messages go to a closed connection."""

    def __init__(self):
        super().__init__(reduction="sum")
        self.calls = 0

    def forward(self, out, y):
        self.calls += 1
        if self.calls == 3:
            if torch.distributed.get_rank() == 1:
                os._exit(17)
            time.sleep(1.0)
        return super().forward(out, y)


def _rank(rank: int, rendezvous: str, report: str) -> None:
    from manualdp.spmd.transport.peers import PeerError
    from manualdp.runners.loop import train_spmd
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(80, 6, generator=g), torch.randint(0, 4, (80,), generator=g)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    try:
        train_spmd(net, DataLoader(TensorDataset(X, y), batch_size=16), [], 1, 0.1, loss_fn=_DieOrDawdle(),
                   timeout=20, progress=False, log=None)
        outcome = "finished"
    except PeerError as e:
        outcome = f"PeerError: {e}"
    except Exception as e:  # noqa: BLE001 - the point is which kind it is
        outcome = f"{type(e).__name__}: {e}"
    with open(report, "w") as f:
        f.write(outcome)
    os._exit(1)


def test_a_peer_gone_before_the_next_post_is_a_peer_error_naming_step_and_peer(tmp_path):
    ctx = mp.get_context("spawn")
    report = str(tmp_path / "rank0.txt")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "rendezvous"), report if r == 0 else os.devnull))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[1].exitcode == 17
    text = open(report).read()
    assert text.startswith("PeerError: rank 0: step 2: no answer from rank 1"), text
