"""The walls around the grader's child (`sandbox_child`): what a student's file may read and write on disk.

It may write in its own folder, its TMPDIR and /dev/shm only, and read only what it must: Python and its libraries
(torch, site-packages, manualdp's package folder: in a checkout, its root may be listed, never read, so that .git
stays out), its answer's folder, /proc, /sys, a few files of /etc and /dev. Up to three
walls hold that, each where the machine allows it, and the grader names those in force (`Walls.held`):

- `mount`: in the mount namespace `processes.UNSHARE` gives the child (where user namespaces are allowed), every
  mount is made read-only but its folder and TMPDIR, and /dev/shm is a fresh tmpfs of capped size. It stops writes
  by any means (a program it runs, ctypes), not reads.
- `landlock`: Linux's Landlock (kernel 5.13 and later, where the kernel has it on), which an unprivileged process
  asks for itself: outside the paths above, the kernel refuses to open, list, write or delete; it holds for every
  process the child starts too (its ranks).
- `audit`: an audit hook (`sys.addaudithook`) that refuses, in the child's Python, `open` for writing and every
  delete, rename, mkdir, chmod... outside its folders, reading outside the paths above, and (where neither wall above
  holds) running a program. Always on: it records the first thing refused (`refused`), so that the grader fails the
  answer naming the path and the operation even where its code caught the error. Alone (no namespaces, no
  Landlock) it is a fallback a determined answer gets round (ctypes, a rank's process, which it does not reach). It
  resolves every link before it judges a path.

The hook also names a Unix socket bound, and a FIFO or node made (os.mkfifo and os.mknod raise no audit event: it
wraps them to raise one), outside its folders. Writes made through ctypes, a program it runs or torch's C++ writer
(`torch.save`) are stopped by the kernel's walls (mount, Landlock) only: the audit hook does not see them. Of a call
through ctypes it sees the name looked up in libc, not the call: a lookup of one that changes a file at a path
(`LIBC_WRITES`: utimes, chmod, mkfifo...) is refused, since the kernel's refusal of its call may go unseen. Where
the answer raised because of one, `tried.py` reads the path from the error, and the grader names it as the hook's
refusals. A path relative to a folder's descriptor
(`dir_fd=`, as shutil.rmtree gives) is judged against that folder (/proc/self/fd/N), not the working folder.

Standard library only.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import socket
import sys

__all__ = ["Walls", "build"]

MS_BIND, MS_REC, MS_NOSUID, MS_NODEV = 4096, 16384, 2, 4
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 444, 445, 446  # the same on every architecture
PR_SET_NO_NEW_PRIVS = 38
FS_EXECUTE, FS_WRITE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_ALL_V1, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = (1 << 13) - 1, 1 << 13, 1 << 14, 1 << 15
FS_FILE = FS_EXECUTE | FS_WRITE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # the rights a rule on a file may hold
ETC = ("ld.so.cache", "ld.so.conf", "hosts", "host.conf", "nsswitch.conf", "gai.conf", "resolv.conf", "localtime",
       "passwd", "group", "mime.types")  # what Python, torch and gloo read in /etc
DEVICES = ("null", "zero", "full", "random", "urandom")
WRITES = {"os.remove": "delete", "os.rmdir": "delete the folder", "shutil.rmtree": "delete the tree",
          "os.rename": "rename", "os.mkdir": "make the folder", "os.link": "link", "os.symlink": "make a link at",
          "os.truncate": "truncate", "os.chmod": "chmod", "os.chown": "chown", "os.utime": "touch",
          "os.setxattr": "set an attribute of", "os.removexattr": "remove an attribute of", "os.chflags": "chflags",
          "shutil.copyfile": "copy onto", "shutil.move": "move", "os.mkfifo": "make a FIFO at",
          "os.mknod": "make a node at", "socket.bind": "bind a socket at"}
READS = {"os.listdir": "list", "os.scandir": "list"}
# where an event's paths are in its audit arguments: (path, the descriptor of the folder it is relative to, or None)
PATHS = {"os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "shutil.move": ((0, None), (1, None)),
         "os.symlink": ((1, 2),), "shutil.copyfile": ((1, None),), "os.remove": ((0, 1),), "os.rmdir": ((0, 1),),
         "shutil.rmtree": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
         "os.utime": ((0, 3),), "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),), "socket.bind": ((1, None),)}
# os functions that raise no audit event of their own (Python 3.11-3.13): the hook wraps them to raise one
SILENT = {"mkfifo": lambda path, mode=0o666, *, dir_fd=None: (path, mode, dir_fd),
          "mknod": lambda path, mode=0o600, device=0, *, dir_fd=None: (path, mode, device, dir_fd)}
# libc's functions that change a file at a path: looked up through ctypes, their calls raise no audit event, and
# what the kernel's walls refuse an answer may ignore; only the name looked up ("ctypes.dlsym") can be seen
LIBC_WRITES = {"utime", "utimes", "lutimes", "futimesat", "utimensat", "chmod", "lchmod", "fchmodat", "chown",
               "lchown", "fchownat", "mkfifo", "mkfifoat", "mknod", "mknodat", "__xmknod", "__xmknodat", "bind",
               "unlink", "unlinkat", "rmdir", "rename", "renameat", "renameat2", "link", "linkat", "symlink",
               "symlinkat", "mkdir", "mkdirat", "truncate", "setxattr", "lsetxattr", "removexattr", "syscall"}
CTYPES = ("ctypes.dlsym", "ctypes.dlsym/handle")
# the "open" event has no descriptor: shutil.rmtree's opens of a folder's entries, relative to that folder's, the
# local variable that holds it (Python 3.11-3.12, then 3.13 on)
RMTREE_OPENS = {"_rmtree_safe_fd": "topfd", "_rmtree_safe_fd_step": "dirfd"}
PROGRAMS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "pty.spawn")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # manualdp's folder
NAMES = {"mount": "a read-only mount namespace", "landlock": "Landlock", "audit": "an audit hook"}


def _audited(name: str, call) -> None:
    """Make os's `name` (its posix function) raise the audit event "os.`name`" with its arguments (`call`'s)."""
    import posix

    real = getattr(posix, name, None)
    if real is None:
        return

    def audited(*args, **kwargs):
        sys.audit(f"os.{name}", *call(*args, **kwargs))
        return real(*args, **kwargs)

    audited.__name__ = audited.__qualname__ = name
    setattr(posix, name, audited)
    setattr(os, name, audited)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


class Walls:
    """The paths the child may write (`writable`) and read (`readable`, besides those), and the walls in force."""

    def __init__(self, writable: list[str], readable: list[str], listable: list[str] = ()):
        self.writable = [os.path.realpath(p) for p in writable]
        self.readable = [os.path.realpath(p) for p in readable if os.path.exists(p)]
        self.listable = [os.path.realpath(p) for p in listable if os.path.isdir(p)]  # listed, none of their files read
        self.held: list[str] = []  # the walls in force, in `NAMES`' words
        self.refused: list[tuple[str, str]] = []  # (operation, path) the audit hook refused, first first

    # ------------------------------------------------------------ the mount namespace

    def mount(self, shm_bytes: int) -> bool:
        """Make every mount read-only but the writable folders, and /dev/shm a tmpfs of `shm_bytes`: inside a mount
        namespace of the child's own only (else the host's mounts would change). Whether it held."""
        libc = _libc()
        if os.path.isdir("/dev/shm") and libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV,
                                                    f"size={shm_bytes}".encode()) != 0:
            return False
        for path in self.writable:  # a mount of its own each, so that it can stay writable below a read-only root
            if libc.mount(path.encode(), path.encode(), None, MS_BIND | MS_REC, None) != 0:
                return False
        if not _setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0):
            return False
        if not all(_setattr(p, 0, 0, MOUNT_ATTR_RDONLY) for p in [*self.writable, "/dev/shm"] if os.path.isdir(p)):
            return False
        os.chdir(os.getcwd())  # the working folder anew, through its writable mount: the old one is read-only
        return True

    # ------------------------------------------------------------ Landlock

    def landlock(self) -> bool:
        """Restrict this process and all it starts to reading `readable` and writing `writable` (Landlock). Whether
        the kernel has it and it held."""
        libc = _libc()
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # _VERSION: its ABI
        if abi < 1:
            return False
        handled = FS_ALL_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (
            FS_IOCTL_DEV if abi >= 5 else 0)
        attr = ctypes.c_uint64(handled)  # the ABI-1 struct: file system rights only
        ruleset = libc.syscall(SYS_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
        if ruleset < 0:
            return False
        try:
            read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
            rules = [(p, read) for p in self.readable] + [(p, handled) for p in self.writable]
            rules += [(p, FS_READ_DIR) for p in self.listable]  # beneath them too: Landlock has no rule for one folder
            rules += [(f"/dev/{d}", FS_READ_FILE | FS_WRITE | FS_IOCTL_DEV) for d in DEVICES] + [("/dev/shm", handled)]
            if not all(_rule(libc, ruleset, path, access & handled) for path, access in rules if os.path.exists(path)):
                return False
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                return False
            return libc.syscall(SYS_LANDLOCK_RESTRICT, ruleset, ctypes.c_uint32(0)) == 0
        finally:
            os.close(ruleset)

    # ------------------------------------------------------------ the audit hook

    def audit(self, programs: bool) -> None:
        """Install the audit hook; `programs`: refuse running programs too (where no wall of the kernel holds)."""
        busy = [False]

        def hook(event: str, args: tuple) -> None:
            if busy[0] or not (event == "open" or event in WRITES or event in READS or event in CTYPES or
                               event.startswith(PROGRAMS)):
                return
            busy[0] = True  # what the judging itself calls is not judged
            try:
                refused = self._judge(event, args, programs)
            except Exception:  # noqa: BLE001 (an argument of a form not foreseen: the kernel's walls judge it)
                refused = None
            finally:
                busy[0] = False
            if refused:
                self.refused.append(refused)
                raise PermissionError(f"manualdp check: your code may not {' '.join(filter(None, refused))}: an "
                                      "answer may write only in its own folder, and read only what it imports")

        sys.addaudithook(hook)
        for name, call in SILENT.items():
            _audited(name, call)

    def _judge(self, event: str, args: tuple, programs: bool) -> tuple[str, str] | None:
        """(operation, path) if the hook refuses `event`, else None."""
        if event.startswith(PROGRAMS):
            program = args[0] if event == "os.system" else args[1] if len(args) > 1 else args[0]  # its command line
            program = os.fsdecode(program) if isinstance(program, bytes) else (
                " ".join(map(os.fsdecode, program)) if isinstance(program, (list, tuple)) else str(program))
            return ("run", program[:200]) if programs else None
        if event == "open":
            path, mode, flags = (list(args) + [None, None])[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & (
                os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writes:
                return self._write("write", path, follow=True)
            return self._read("read", path, _folder_of(_rmtree_fd()))
        if event in READS:
            return self._read(READS[event], args[0] if args else ".")
        if event in CTYPES:
            return (f"call libc's {args[1]} through ctypes, whose calls the grader cannot judge", "") if (
                args[1] in LIBC_WRITES) else None
        if event == "socket.bind" and (getattr(args[0], "family", None) != socket.AF_UNIX or not isinstance(
                args[1], (str, bytes)) or args[1][:1] in ("\0", b"\0", "", b"")):  # abstract sockets: no file
            return None
        for at, fd_at in PATHS.get(event, ((0, None),)):
            folder = _folder_of(args[fd_at] if fd_at is not None and fd_at < len(args) else None)
            refused = self._write(WRITES[event], args[at], event in ("os.truncate", "os.chmod", "shutil.copyfile"),
                                  folder)
            if refused:
                return refused
        return None

    def _write(self, what: str, path, follow: bool, folder: str | None = None) -> tuple[str, str] | None:
        full = _full(path, follow, folder)
        return None if full is None or _under(full, [*self.writable, "/dev/shm"]) or full in (
            f"/dev/{d}" for d in DEVICES) else (what, full)

    def _read(self, what: str, path, folder: str | None = None) -> tuple[str, str] | None:
        full = _full(path, True, folder)  # every link resolved first: one in its own folder may lead to /etc/shadow
        return None if full is None or _under(full, [*self.readable, *self.writable, "/dev/shm"]) or full in (
            f"/dev/{d}" for d in DEVICES) or what == "list" and full in self.listable else (what, full)

    def named(self) -> str:
        """The walls in force, in words."""
        return ", ".join(NAMES[w] for w in self.held) or "none"


def _full(path, follow: bool, folder: str | None = None) -> str | None:
    """`path` absolute (relative to `folder` if given, else to the working folder), its links resolved (the last one
    only if `follow`); None for a file descriptor."""
    if path is None or isinstance(path, int):
        return None
    path = os.path.abspath(os.path.join(folder or os.getcwd(), os.fsdecode(os.fspath(path))))
    if follow:
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _folder_of(fd) -> str | None:
    """The folder that the descriptor `fd` names (a path given with `dir_fd=fd` is relative to it), or None where
    there is none (no descriptor, AT_FDCWD, the working folder)."""
    if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
        return None
    return os.readlink(f"/proc/self/fd/{fd}")


def _rmtree_fd() -> int | None:
    """The folder's descriptor that shutil.rmtree opens an entry relative to, where it is rmtree that opens."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:  # the hook's own frames
        frame = frame.f_back
    if frame is None or frame.f_code.co_name not in RMTREE_OPENS or frame.f_code.co_filename != shutil.__file__:
        return None
    return frame.f_locals.get(RMTREE_OPENS[frame.f_code.co_name])


def _setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> bool:
    """mount_setattr(2) on `path`: set and clear mount attributes (of every mount below, with AT_RECURSIVE)."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    attr = (ctypes.c_uint64 * 4)(attr_set, attr_clr, 0, 0)
    return libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), ctypes.c_uint(flags), ctypes.byref(attr),
                        ctypes.c_size_t(32)) == 0


def _rule(libc, ruleset: int, path: str, access: int) -> bool:
    """Allow `access` beneath `path` (a folder; on a file, only the rights a file can have)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return True  # gone meanwhile: nothing to allow
    try:
        if not os.path.isdir(path):
            access &= FS_FILE
        attr = (ctypes.c_ubyte * 12).from_buffer_copy(access.to_bytes(8, sys.byteorder) + fd.to_bytes(4, sys.byteorder))
        rule = ctypes.c_int(1)  # LANDLOCK_RULE_PATH_BENEATH
        return libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, rule, ctypes.byref(attr), ctypes.c_uint32(0)) == 0
    finally:
        os.close(fd)


def build(folder: str, tmp: str, answer: str) -> Walls:
    """The walls for a child working in `folder` with TMPDIR `tmp` that loads the file `answer`: what it may read is
    Python's and its libraries' folders, manualdp's, the answer's folder, /proc, /sys and a few files of /etc."""
    pythons = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    checkout = _checkout()
    library = [p for p in sys.path if p and os.path.isabs(p) and os.path.realpath(p) != checkout] + [_PACKAGE]
    if checkout:  # an editable install's metadata beside the package: importlib.metadata reads its entry points
        library += [os.path.join(checkout, f) for f in os.listdir(checkout) if f.endswith((".egg-info", ".dist-info"))]
    system = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/proc", "/sys", *(f"/etc/{f}" for f in ETC)]
    answers = {os.path.dirname(os.path.abspath(answer)), os.path.dirname(os.path.realpath(answer))}  # a link's too
    return Walls([folder, tmp], [*sorted(pythons), *library, *system, *sorted(answers)],
                 [checkout] if checkout else [])


def _checkout() -> str | None:
    """The folder that holds manualdp's where it is a checkout (its .git, its tests...), not site-packages: a rank
    imports manualdp by listing it, and needs none of its other files."""
    root = os.path.dirname(os.path.realpath(_PACKAGE))
    return None if os.path.basename(root) in ("site-packages", "dist-packages") else root
