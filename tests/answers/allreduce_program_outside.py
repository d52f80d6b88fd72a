"""Right, but runs a program that writes a stamp beside its folder: the kernel refuses, the program says so on
stderr, and the answer raises subprocess's CalledProcessError, which does not name the file."""
import os
import subprocess


def allreduce(tensors):
    subprocess.run(["touch", os.path.join(os.path.dirname(os.getcwd()), "stamp")], check=True)
    total = sum(t.clone() for t in tensors)
    for t in tensors:
        t.copy_(total)
