"""Right, but touches and chmods a file beside its folder through libc (ctypes), ignoring what libc returns: no audit
event comes of the calls, and the kernel's refusal is never raised (an adversary's answer, issue 45: it passed)."""
import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)


def allreduce(tensors):
    victim = os.path.join(os.path.dirname(os.getcwd()), "victim.txt").encode()
    libc.utimes(victim, None)
    libc.chmod(victim, 0o600)
    total = sum(t.clone() for t in tensors)
    for t in tensors:
        t.copy_(total)
