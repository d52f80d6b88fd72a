"""Right, and tidy: it keeps scratch files in a tree of its own folder, then removes that tree from another working
folder (`/`), where shutil.rmtree's names, relative to each folder's descriptor, would mean other paths."""
import os
import shutil


def allreduce(tensors):
    here = os.getcwd()
    os.makedirs("scratch/deep/deeper", exist_ok=True)
    for name in ("scratch/a.txt", "scratch/deep/b.txt", "scratch/deep/deeper/c.txt"):
        with open(name, "w") as f:
            f.write("scratch")
    os.chdir("/")
    try:
        shutil.rmtree(os.path.join(here, "scratch"))
    finally:
        os.chdir(here)
    total = sum(t.clone() for t in tensors)
    for t in tensors:
        t.copy_(total)
