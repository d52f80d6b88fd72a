"""`save_checkpoint` and `load_checkpoint` (chapter 7): a run stopped, saved and resumed (in one process, then in a
new one from the file moved to a new name) ends bitwise where the uninterrupted run does, and a wrong resume is
told what it did not keep (`RESUME_SLIPS`); what hypothesis draws for it (`DRAWN`). The run itself is `jobs.py`'s."""
from __future__ import annotations

import copy
import os
import random

import torch
from hypothesis import strategies as st

from ..jobs import Resumed, resume_load, resume_save, train_resumed
from .common import Mismatch, called, show

__all__ = ["resume_property", "resume_in_a_new_process_property", "DRAWN"]


def _resume_as(optimizer: str, steps: int, stop_at: int, seed: int, reseed: int, keep: tuple[str, ...]) -> dict:
    """The parameters of a run resumed at `stop_at` that kept only `keep` of ("model", "optimizer", "rng")."""
    def save(path, model, opt, step):
        saved.update(step=step, model=copy.deepcopy(model.state_dict()), optimizer=copy.deepcopy(opt.state_dict()),
                     rng=torch.get_rng_state())

    def load(path, model, opt):
        if "model" in keep:
            model.load_state_dict(saved["model"])
        if "optimizer" in keep:
            opt.load_state_dict(saved["optimizer"])
        if "rng" in keep:
            torch.set_rng_state(saved["rng"])
        return saved["step"]

    saved: dict = {}
    resume_save(save, load, optimizer, steps, stop_at, seed)
    return resume_load(save, load, optimizer, steps, reseed)["params"]


KEPT = {"model": "the model", "optimizer": "the optimizer's state", "rng": "torch's random number generator"}
RESUME_SLIPS = {  # what a resume kept -> what it missed, and how to keep it
    ("model", "optimizer"): "torch's random number generator, which draws the batches and the dropout masks: save "
                            "torch.get_rng_state() and restore it with torch.set_rng_state()",
    ("model", "rng"): "the optimizer's state (momentum, Adam's moments and step count): save optimizer.state_dict() "
                      "and restore it with optimizer.load_state_dict()",
    ("model",): "the optimizer's state and torch's random number generator: save optimizer.state_dict() and "
                "torch.get_rng_state(), and restore both",
    (): "anything: load the model's state_dict too",
}


def _uninterrupted(optimizer: str, steps: int, seed: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = Resumed()
        train_resumed(model, optimizer, 0, steps)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def resume_in_a_new_process_property(child, optimizer: str = "sgd", steps: int = 4, stop_at: int = 2,
                                     seed: int | None = None, reseed: int | None = None) -> None:
    """As `resume_property`, with `load_checkpoint` in a new process (a `sandbox.Child` restarted in the same folder),
    given the file moved to a new name: what the resume needs must be in the file at the path it was given. The seeds
    are drawn here, at random (unless given), so that no answer can know the run's seed but from the file."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    reseed = random.SystemRandom().randrange(2**31) if reseed is None else reseed
    path, moved = "saved.pt", os.path.join("moved", "resumed.pt")
    call = (f"a run of {steps} steps ({'SGD with momentum 0.9' if optimizer == 'sgd' else 'Adam'}, torch.manual_seed"
            f"({seed})) stopped after step {stop_at} and saved by save_checkpoint({path!r}, ...), then resumed by "
            f"load_checkpoint({moved!r}, ...) in a new process (the same folder, the file moved there, nothing else "
            "kept)")
    called(call, child, optimizer, steps, stop_at, seed, path, job="resume_save")
    if not os.path.exists(os.path.join(child.folder, path)):
        raise Mismatch(f"{call}: {_unsaved(path)}")
    os.makedirs(os.path.join(child.folder, os.path.dirname(moved)), exist_ok=True)
    os.replace(os.path.join(child.folder, path), os.path.join(child.folder, moved))
    loaded = child.restart()
    if not loaded.get("ok"):
        raise Mismatch(f"{call}: the file no longer loads in a new process: {loaded}")
    try:
        _, _, out = called(call, child, optimizer, steps, reseed, moved, job="resume_load")
    except Mismatch as e:
        raise Mismatch(f"{e}. A new process starts with nothing but the file: does save_checkpoint write everything "
                       "the resume needs into it, and does load_checkpoint read the path it is given?") from None
    _judge_resume(call, out, optimizer, steps, stop_at, seed, reseed, new_process=True)


def resume_property(fns, optimizer: str, run: tuple[int, int], seed: int, reseed: int) -> None:
    """A run of `steps` stopped after `stop_at` (`run`) and resumed by the student's functions ends bitwise where the
    uninterrupted run does (computed here, in the grader's process)."""
    steps, stop_at = run
    call = (f"a run of {steps} steps ({'SGD with momentum 0.9' if optimizer == 'sgd' else 'Adam'}, dropout, batches "
            f"drawn with torch.randint, torch.manual_seed({seed})) stopped after step {stop_at}, saved by "
            f"save_checkpoint(path, model, optimizer, {stop_at}), then resumed in a new model and optimizer "
            f"(torch.manual_seed({reseed}), as a new process would seed it) by load_checkpoint(path, model, optimizer)")
    _, _, out = called(call, fns, optimizer, steps, stop_at, seed, reseed, job="resume")
    if isinstance(out, dict) and "unsaved" in out:
        raise Mismatch(f"{call}: {_unsaved(out['unsaved'])}")
    _judge_resume(call, out, optimizer, steps, stop_at, seed, reseed)


def _unsaved(path: str) -> str:
    """What to say of a save_checkpoint that wrote nothing at the path it was given."""
    return (f"save_checkpoint({path!r}, ...) wrote nothing at {path!r}: write the checkpoint to the path it is given, "
            "the one load_checkpoint is then given (a new process, where a run resumes, starts with nothing but that "
            "file)")


def _judge_resume(call: str, out, optimizer: str, steps: int, stop_at: int, seed: int, reseed: int,
                  new_process: bool = False):
    """Raise `Mismatch` unless the resumed run `out` ({"step", "params"}) ends bitwise as the uninterrupted one."""
    full = _uninterrupted(optimizer, steps, seed)
    step = out.get("step") if isinstance(out, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        kind = "tensor" if isinstance(step, torch.Tensor) else type(step).__name__
        raise Mismatch(f"{call}: load_checkpoint returned {show(step)}, a {kind}, not an int: return the step as a "
                       f"Python int ({stop_at} here, the number of steps done), which the loop goes on from"
                       + (": save the int itself, or return `int(...)` of the tensor" if kind == "tensor" else ""))
    if step != stop_at:
        raise Mismatch(f"{call}: load_checkpoint returned {show(step)}, expected {stop_at}, the step that was saved "
                       "(the number of steps done): the loop goes on from the step it returns")
    got = out.get("params")
    if not isinstance(got, dict) or set(got) != set(full):
        keys = sorted(got)[:6] if isinstance(got, dict) else got
        raise Mismatch(f"{call}: the resumed model's state_dict has keys {keys}, expected {sorted(full)}")
    diff = next((k for k in full if not torch.equal(got[k], full[k])), None)
    if diff is None:
        return
    d = (got[diff] - full[diff]).abs()
    i = int(d.flatten().argmax())

    def hint() -> str:  # told once, for the example hypothesis reports, not for every one it tries while shrinking
        if new_process:
            return (". It resumed right in one process: does save_checkpoint keep part of the state in memory? "
                    "Everything the rest of the run needs must be in the file")
        slip = next((keep for keep in RESUME_SLIPS
                     if all(torch.equal(got[k], v)
                            for k, v in _resume_as(optimizer, steps, stop_at, seed, reseed, keep).items())), None)
        return ("" if slip is None else f". Your resume equals one that restored "
                f"{' and '.join(KEPT[k] for k in slip) or 'nothing'} but not {RESUME_SLIPS[slip]}")

    raise Mismatch(f"{call}: the parameters differ from the uninterrupted run's: {diff}, element {i}, is "
                   f"{got[diff].flatten()[i].item():.9g} where the uninterrupted run has "
                   f"{full[diff].flatten()[i].item():.9g}", hint)


DRAWN = dict(optimizer=st.sampled_from(["sgd", "adam"]),
             run=st.integers(2, 8).flatmap(lambda steps: st.tuples(st.just(steps), st.integers(1, steps - 1))),
             seed=st.integers(0, 2**31 - 1), reseed=st.integers(0, 2**31 - 1))
