"""Right, but logs through libc (ctypes) into a file beside its folder: no audit hook sees it; the kernel refuses."""
import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)


def allreduce(tensors):
    log = os.path.join(os.path.dirname(os.getcwd()), "log.txt")
    fd = libc.open(log.encode(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), log)
    libc.close(fd)
    total = sum(t.clone() for t in tensors)
    for t in tensors:
        t.copy_(total)
