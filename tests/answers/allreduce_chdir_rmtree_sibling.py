"""Right, but careless: from its folder's parent it removes `victim`, a folder beside its own, not of its own."""
import os
import shutil


def allreduce(tensors):
    here = os.getcwd()
    os.chdir(os.path.dirname(here))
    try:
        shutil.rmtree("victim", ignore_errors=True)  # the error caught: the grader must refuse it all the same
    finally:
        os.chdir(here)
    total = sum(t.clone() for t in tensors)
    for t in tensors:
        t.copy_(total)
