"""`form_group`: a group forms after this process failed to form one (a member gone in the rendezvous).

About 20 s here (two processes that import torch, a rendezvous that must time out), so in bench/.
"""
import subprocess
import sys


from manualdp.spmd.ft import Coordinator

CHILD = """
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from manualdp.spmd.ft.group import form_group
port, rank, fail_first = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
store = dist.TCPStore("127.0.0.1", port, is_master=False)
if fail_first:
    try:  # a group of 2 whose other member never comes
        form_group(store, 1, 0, 2, timeout=0.5)
        raise SystemExit("the group of a missing member formed")
    except RuntimeError:
        pass
form_group(store, 2, rank, 2, timeout=20)
t = torch.ones(1)
dist.all_reduce(t)
print(int(t.item()), flush=True)
"""


def test_a_group_forms_after_a_failed_rendezvous_in_one_member():
    # torch 2.13 names the rendezvous keys by a per-process counter that a failed init_process_group leaves one up:
    # the member that failed waited on other keys than its peer until the deadline
    coordinator = Coordinator(0)
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(coordinator.port), str(r), str(1 - r)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert [o.strip().splitlines()[-1] for o in outs] == ["2", "2"], outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        coordinator.close()
