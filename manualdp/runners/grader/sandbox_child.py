"""The grader's child: the one process where a student's file runs (`manualdp check`, `sandbox.Child`).

    python -m manualdp.runners.grader.sandbox_child MEMORY_BYTES DISK_BYTES WALLS     (by the grader, never by hand)

It forks at once: the parent stays as the child's init, which reaps it and tells the grader on stderr how it ended
(in `processes.UNSHARE`'s namespaces it is their PID 1, which nothing inside can signal), so that the student's
`os.kill(os.getppid(), ...)` reaches the init, not the grader; the child dies with its init. The child gives up
CAP_SYS_PTRACE, caps its own memory and file sizes, sends what the file prints to `output.txt` in its working folder
(a temporary one of its own), puts up its walls (`walls.py`: what it may read and write; the mount namespace's at
once, Landlock's and the audit hook's before it loads the file, and tells the grader which hold), then answers the
grader's requests on its stdin and stdout, one frame each: `load` a file (and tell, for each name, the file its code
was defined in and its module), `call` its function on the inputs sent, run one of the grader's `job`s (`jobs.JOBS`)
with the file's functions (a training run that saves and resumes), or start `ranks` (2, or the request's
`world_size`, up to 4) that run a job of the grader's with the file (train its DDP, register its comm hook). It
judges nothing: it sends back the inputs and the output as they are after the call, in one `torch.save`, so that the
grader sees which tensors share memory, and judges them itself.

Before it loads the file, the library's function the exercise asks for (`own.LIBRARY`) is made to raise "write it
yourself" when called, and a class built on torch's or manualdp's DDP is refused at load. The file runs in the
process that measures it: a rank binds the grader's functions before the file loads and fails one that replaced
them, or torch's or manualdp's (`intact.py`); a patch undone before the rank ends is not seen, and the checks that
matter compare against references computed where the file never runs.
"""
from __future__ import annotations

import functools
import importlib.util
import io
import os
import resource
import signal
import stat
import struct
import sys
import traceback
import types

from . import walls
from .own import write_it_yourself
from .processes import ENDED, die_with_parent
from .tried import outside

LOG_BYTES = 64 << 20  # what the student's code may print or write into one file
# what each rank runs, given the file's path and name
RANK_JOBS = {"ddp": "ddp_job", "hook": "hook_job", "buckets": "buckets_job"}
PR_CAPBSET_DROP, CAP_SYS_PTRACE, CAPABILITY_VERSION_3 = 24, 19, 0x20080522
TORCH_DDP = "torch.nn.parallel.distributed.DistributedDataParallel"
WORLD_SIZES = (2, 3, 4)  # how many ranks a `ranks` request may start (2 unless it says `world_size`)


def _init() -> None:
    """Fork; return in the child, which answers the grader. The parent is its init: it reaps every process that
    ends under it, writes `ENDED` and how the child ended to stderr, and exits."""
    parent, kill_me = os.getpid(), die_with_parent()
    child = os.fork()
    if child == 0:
        kill_me()
        if os.getppid() != parent:  # the init ended before the line above
            os._exit(1)
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: as a namespace's PID 1, nothing inside can end it
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the grader's pipes are the child's alone, so that they close when it ends
    os.dup2(null, 1)
    while True:
        pid, status = os.wait()
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            try:
                os.write(2, f"\n{ENDED} {code}\n".encode())
            except OSError:
                pass
            os._exit(code if code >= 0 else 128 - code)


def _drop_ptrace() -> None:
    """Give up CAP_SYS_PTRACE for good (from the bounding set too, so that no exec brings it back): without it, a
    process may open another's /proc/PID/fd or mem only where that one holds no capability it lacks, which keeps the
    child out of the grader's where both run as root without namespaces (there the grader's not being dumpable does
    not stop root). A process that does not hold it (not root) is left as it is."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0)  # fails where it lacks CAP_SETPCAP: then it is no root
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: capabilities 0-31, then 32-63
    if libc.capget(header, sets) == 0:
        for i in range(3):
            sets[i] &= ~(1 << CAP_SYS_PTRACE)
        libc.capset(header, sets)


def _frames(fd_in: int, fd_out: int, refused: list):
    """A `recv()` and a `send(obj)` of length-prefixed frames on two file descriptors; `send` adds to a dict the first
    thing the walls refused (`refused`, as `walls.Walls.refused`, filled later), once there is one."""
    import torch

    save, load = torch.save, torch.load  # taken before the student's file can patch them

    def recv():
        head = _read(fd_in, 8)
        return load(io.BytesIO(_read(fd_in, struct.unpack(">Q", head)[0])), weights_only=False)

    def send(obj) -> None:
        if refused and isinstance(obj, dict):
            obj = {**obj, "refused": list(refused[0])}
        buf = io.BytesIO()
        try:
            save(obj, buf)
        except Exception as e:  # noqa: BLE001 (an output torch cannot save: a subclass, a view of a view...)
            buf = io.BytesIO()
            save({"error": f"what it returned cannot be sent to the grader ({type(e).__name__}: {e})"}, buf)
        data = buf.getvalue()
        os.write(fd_out, struct.pack(">Q", len(data)))
        view = memoryview(data)
        while view:
            view = view[os.write(fd_out, view):]

    return recv, send


def _read(fd: int, n: int) -> bytes:
    parts = []
    while n:
        part = os.read(fd, n)
        if not part:
            raise SystemExit(0)  # the grader closed the pipe: it is done with us
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _plain(obj, depth: int = 0):
    """`obj` as what the grader may load (tensors, numbers, strings, lists, tuples, dicts of strings), the same tensor
    objects kept; a `Schedule` as a tagged dict; anything else as its repr."""
    import torch

    from ...transfers import Schedule

    if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
        return obj
    if obj is None or type(obj) in (bool, int, float, str, torch.device, torch.dtype):
        return obj
    if depth < 6 and _numpy_number(obj):  # np.float64(0.5), np.int64(3), np.array(2.0): the number it holds
        return _plain(obj.item(), depth + 1)
    if depth < 6 and isinstance(obj, Schedule):
        return {"__schedule__": [obj.num_devices, obj.num_chunks, _plain(obj.rounds, depth + 1)]}
    if depth < 6 and type(obj) is dict and len(obj) <= 10_000 and all(type(k) is str for k in obj):
        return {k: _plain(v, depth + 1) for k, v in obj.items()}
    if depth < 6 and isinstance(obj, (list, tuple)) and len(obj) <= 100_000:
        items = [_plain(x, depth + 1) for x in obj]
        return items if isinstance(obj, list) else tuple(items)
    try:
        text = repr(obj)[:200]
    except BaseException:  # noqa: BLE001 (a repr that raises)
        text = f"<{type(obj).__name__}>"
    return {"__object__": text}


def _numpy_number(obj) -> bool:
    """Whether `obj` is a numpy bool, integer or real number, or a 0-dim array of one (which numpy's own arithmetic
    makes of scalars): numpy is imported already where it is one."""
    np = sys.modules.get("numpy")
    return (np is not None and isinstance(obj, (np.generic, np.ndarray)) and type(obj).__module__ == "numpy"
            and obj.ndim == 0 and obj.dtype.kind in "biuf")


def _raised(e: BaseException, path: str, walled: walls.Walls | None = None) -> dict:
    """What the grader needs to tell an exception: its type, message and the line of the student's file. Where it
    says that a wall of the kernel refused a path outside the child's folders, that goes into `walled.refused`."""
    try:
        tried = walled and outside(e, [*walled.writable, "/dev/shm"], _printed(walled.writable[0]))
    except Exception:  # noqa: BLE001 (an error of the student's whose attributes raise: told as it is)
        tried = None
    if tried:
        walled.refused.append(tried)
    frames = traceback.extract_tb(e.__traceback__)
    torch_dir = os.path.dirname(sys.modules["torch"].__file__)
    frame = next((f for f in reversed(frames) if f.filename == path), None) or next(
        (f for f in reversed(frames) if not f.filename.startswith(torch_dir)), frames[-1] if frames else None)
    try:
        message = str(e)[:500]
    except BaseException:  # noqa: BLE001
        message = "(its message cannot be printed)"
    return {"raised": type(e).__name__, "message": message,
            "at": f"{frame.filename}, line {frame.lineno}" if frame else ""}


def _printed(folder: str) -> str:
    """The last lines in the child's `output.txt` (in `folder`): what its programs said on stderr."""
    try:  # without blocking or following a link: the answer may have put a FIFO or a link in its place
        fd = os.open(os.path.join(folder, "output.txt"), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        os.lseek(fd, max(0, os.fstat(fd).st_size - 4000), os.SEEK_SET)
        return os.read(fd, 4000).decode(errors="replace")
    finally:
        os.close(fd)


def _built_on(cls) -> str | None:
    """The library's DDP class that the class `cls` is built on (torch's or manualdp's), or None."""
    for base in cls.__mro__[1:]:
        name = f"{base.__module__}.{base.__qualname__}"
        if name == TORCH_DDP or base.__module__.startswith("manualdp.spmd."):
            return name
    return None


def _load(path: str, names: list[str], walled: walls.Walls) -> dict:
    sys.path.insert(0, os.path.dirname(path))  # as `python FILE.py` would: the file's neighbours import
    spec = importlib.util.spec_from_file_location("exercise", path)
    if spec is None or spec.loader is None:
        return {"error": f"{path}: not a Python file (it should end in .py)"}
    module = importlib.util.module_from_spec(spec)
    sys.modules["exercise"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 (anything in a student's file, SystemExit and KeyboardInterrupt too)
        return {"import_raised": _raised(e, path, walled)}
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        return {"missing": missing[0]}
    fns = [getattr(module, name) for name in names]
    built = [(name, _built_on(fn)) for name, fn in zip(names, fns) if isinstance(fn, type)]
    if any(base for _, base in built):
        return {"own": next([name, base] for name, base in built if base)}
    origins = [_origin(fn) for fn in fns]
    return {"ok": True, "fns": fns, "defined_in": {name: file for name, (file, _) in zip(names, origins)},
            "module": {name: module for name, (_, module) in zip(names, origins)}}


def _origin(fn) -> tuple[str | None, str | None]:
    """The file that `fn`'s code was defined in (that of the function it wraps, for a decorator's that says so, as
    `torch.no_grad()`'s, `functools.cache`'s and a `partial` do) and its `__module__`: so that the grader can tell the
    library's own function taken for an answer. Each None where there is none (a class, a builtin) or it is not a
    string."""
    try:
        inner = fn
        for _ in range(10):
            wrapped = inner.func if isinstance(inner, functools.partial) else getattr(inner, "__wrapped__", None)
            if wrapped is None:
                break
            inner = wrapped
        code = getattr(inner, "__code__", None)
        file = code.co_filename if isinstance(code, types.CodeType) else None
        module = getattr(fn, "__module__", None)
    except BaseException:  # noqa: BLE001 (an attribute of the student's that raises)
        return None, None
    return (file if type(file) is str else None), (module if type(module) is str else None)


def _walled(wanted: list[str], mounted: bool, path: str, refused: list) -> walls.Walls:
    """The walls (`walls.py`) around the file at `path`, put up before it loads: `wanted` of them where they hold."""
    built = walls.build(os.getcwd(), os.environ.get("TMPDIR", os.getcwd()), path)
    built.held, built.refused = ["mount"] if mounted else [], refused
    if "landlock" in wanted and built.landlock():
        built.held.append("landlock")
    built.audit(programs=not built.held)  # alone, it refuses running programs too: nothing else would stop them
    built.held.append("audit")
    return built


def main() -> None:
    memory, disk, wanted = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    _drop_ptrace()
    _init()
    mounted = "mount" in wanted and walls.Walls([os.getcwd(), os.environ.get("TMPDIR", os.getcwd())], []).mount(disk)
    fd_in, fd_out = os.dup(0), os.dup(1)  # the grader's pipes, kept apart from what the student prints
    log = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (LOG_BYTES, LOG_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    refused = []  # what the walls refused, first first: they go up when the file is loaded
    recv, send = _frames(fd_in, fd_out, refused)
    import torch

    torch.set_num_threads(1)
    send({"ready": True})
    fns, names, path, walled = [], [], "", None
    while True:
        req = recv()
        if req["op"] == "load":
            path, names = req["path"], req["names"]
            write_it_yourself(names)
            walled = _walled(wanted, mounted, path, refused)
            got = _load(path, names, walled)
            fns = got.pop("fns", [])
            send({**got, "walls": walled.named()})
        elif req["op"] in ("call", "job"):
            args = req["args"]
            before = _plain(args)  # the caller's own references, before the call can rebind a list's slots
            try:
                if req["op"] == "call":
                    out = fns[0](*args)
                else:  # the grader's code, which calls the file's functions; what it returns is judged by the grader
                    from . import jobs

                    out = getattr(jobs, jobs.JOBS[req["job"]])(*fns, *args)
            except BaseException as e:  # noqa: BLE001
                send(_raised(e, path, walled))
                continue
            send({"before": before, "after": _plain(args), "out": _plain(out)})
        elif req["op"] == "ranks":
            from ...spmd.launch import launch
            from . import properties

            world_size = req.get("world_size", 2)
            if world_size not in WORLD_SIZES:
                send({"error": f"world_size must be one of {WORLD_SIZES}, got {world_size!r}"})
                continue
            try:
                job = getattr(properties, RANK_JOBS[req["job"]])
                send({"ranks": launch(job, world_size, (path, names[0]), timeout=req["timeout"])})
            except TimeoutError:
                send({"timeout": True})
            except Exception as e:  # noqa: BLE001 (a rank that died: its last lines)
                send({"rank_died": (str(e).strip().splitlines() or [type(e).__name__])[-1]})


if __name__ == "__main__":
    main()
