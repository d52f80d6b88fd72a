"""The architecture of ARCHITECTURE.md, held by tests: which layer may import which, and a book a student can read."""
import ast
import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import manualdp

ROOT = pathlib.Path(manualdp.__file__).parent
COMPAT = {"distributed", "__init__", "__main__"}  # the package's front doors re-export every layer


def layer(module: str) -> str:
    """'checks', 'book', 'engine', 'utility' or 'runner' for a dotted name below `manualdp`."""
    first = module.split(".")[0]
    return {"validate": "checks", "spmd": "engine", "support": "utility", "runners": "runner"}.get(first, "book")


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, path


def imports(name: str, path: pathlib.Path):
    """(imported manualdp module, the names it takes) for every import in the file, at any depth."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("manualdp"):
                target = node.module[len("manualdp."):] if "." in node.module else ""
            else:
                continue
            names = [a.name for a in node.names]
            if node.module is None:  # `from . import x`: x is a module
                for n in names:
                    yield (f"{target}.{n}" if target else n), []
            else:
                yield target, names
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("manualdp."):
                    yield a.name[len("manualdp."):], []


ALLOWED = {  # every layer may use the validators; they use nothing
    "checks": set(),
    "book": {"checks", "book"},
    "engine": {"checks", "book", "engine", "utility"},
    "utility": {"checks", "utility"},
    "runner": {"checks", "book", "engine", "utility", "runner"},
}


ARROWS = [m for m in modules() if m[0].split(".")[-1] not in COMPAT and m[0]]  # the front doors re-export all


@pytest.mark.parametrize("name, path", ARROWS, ids=lambda x: str(x) if isinstance(x, str) else "")
def test_arrows_point_one_way(name, path):
    mine = layer(name)
    for target, _ in imports(name, path):
        if not target:
            continue
        assert layer(target) in ALLOWED[mine], f"{name} ({mine}) imports {target} ({layer(target)})"


def test_the_checker_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "split.py"
    bad.write_text("from .support.checkpoint import save_checkpoint\nfrom .spmd import ddp\n")
    found = [layer(t) for t, _ in imports("split", bad)]
    assert found == ["utility", "engine"]


def test_the_walk_sees_every_python_file_of_the_package():
    # counted apart from rglob: a move into a folder the walk skipped would otherwise pass unchecked
    found = sorted(pathlib.Path(folder, name) for folder, _, names in os.walk(ROOT)
                   for name in names if name.endswith(".py"))
    assert sorted(path for _, path in modules()) == found
    checked = [name for name, _ in ARROWS]
    assert len(checked) == len(found) - sum(name.split(".")[-1] in COMPAT or not name for name, _ in modules())
    assert len(set(checked)) == len(checked)


def test_every_sub_package_is_in_a_known_layer_and_the_engines_in_a_known_room():
    packages = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.rglob("__init__.py") if p.parent != ROOT)
    assert {"support", "runners", "spmd", "spmd.transport", "spmd.ladder", "spmd.ddp"} <= set(packages), packages
    for package in packages:
        assert layer(package) in ALLOWED, package
        folder = f"manualdp/{package.replace('.', '/')}/"
        assert layer(package) != "book", f"{folder} is in no layer: the book has no folders"
        if package.startswith("spmd."):
            assert room(package) in ROOMS, package  # room() raises KeyError for a room it does not know
    for name, _ in modules():
        if layer(name) == "engine" and name != "spmd":
            room(name)


# ---------------------------------------------------------------- the engine's rooms

# The engine's rooms in order (an arrow points back up this list), each with its files and folders below spmd/.
# The one map: spmd/__init__.py's docstring and ARCHITECTURE.md list the same rooms, in this order, with these names
# (test_the_three_maps_agree).
MAP = {
    "transport": ["transport/"],
    "auto": ["auto/"],
    "collectives": ["collectives.py", "comm_hooks.py", "syncbn.py"],  # what users call, and what rests on it alone
    "ladder": ["ladder/"],
    "ddp": ["ddp/"],
    "sharding": ["sharding/"],
    "launch": ["launch.py", "sampler.py"],
    "ft": ["ft/"],  # fault tolerance: on transport, the collectives, the ladder and ddp's reducer; nothing imports it
}
ROOMS = list(MAP)
ROOM_OF = {entry.rstrip("/").removesuffix(".py"): name for name, entries in MAP.items() for entry in entries}
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()  # (module, imported module) pairs the order allows for now: none


def room(module: str) -> str:
    """The room of `spmd.X...`: the first name below spmd/ (a file or a folder). A KeyError for one not in ROOM_OF."""
    parts = module.split(".")
    assert parts[0] == "spmd" and len(parts) > 1, module
    return ROOM_OF[parts[1]]


def room_arrows(name: str, path: pathlib.Path):
    """(imported engine module, its room) for every import of an engine module in the file."""
    for target, taken in imports(name, path):
        if target == "spmd":  # `from .. import x` from spmd/X/: the names are modules of the engine
            for t in taken:
                yield f"spmd.{t}", room(f"spmd.{t}")
        elif target.startswith("spmd."):
            yield target, room(target)


ENGINE = [m for m in modules() if layer(m[0]) == "engine" and m[0] != "spmd"]  # spmd/__init__ is the front door


@pytest.mark.parametrize("name, path", ENGINE, ids=lambda x: str(x) if isinstance(x, str) else "")
def test_rooms_import_only_their_own_room_or_rooms_before_it(name, path):
    mine = ROOMS.index(room(name))
    for target, theirs in room_arrows(name, path):
        if (name, target) in KNOWN_EXCEPTIONS:
            continue
        assert ROOMS.index(theirs) <= mine, (
            f"{name} (room {room(name)}) imports {target} (room {theirs}): rooms import only {ROOMS[:mine + 1]}")


@pytest.mark.parametrize("name, path", [m for m in ENGINE if m[0].split(".")[1] == "ladder"],
                         ids=lambda x: str(x) if isinstance(x, str) else "")
def test_the_ladder_imports_nothing_from_ddp_sharding_or_auto(name, path):
    # auto comes before the ladder in the order; the ladder's rungs still take an algorithm by name only
    found = [target for target, theirs in room_arrows(name, path) if theirs in ("ddp", "sharding", "auto")]
    assert not found, f"{name} imports {found}"


def test_the_room_checker_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "flat.py"
    bad.write_text("from ..ddp.reducer import Reducer\nfrom .. import syncbn\nfrom ..transport.peers import wait\n"
                   "from manualdp.spmd.sharding import zero\n")
    assert [t for t, _ in room_arrows("spmd.ladder.flat", bad)] == [
        "spmd.ddp.reducer", "spmd.syncbn", "spmd.transport.peers", "spmd.sharding"]
    wrong = r"spmd.ladder.flat \(room ladder\) imports spmd.ddp.reducer \(room ddp\)"
    with pytest.raises(AssertionError, match=wrong):
        test_rooms_import_only_their_own_room_or_rooms_before_it("spmd.ladder.flat", bad)
    with pytest.raises(AssertionError, match="imports \\['spmd.ddp.reducer', 'spmd.sharding'\\]"):
        test_the_ladder_imports_nothing_from_ddp_sharding_or_auto("spmd.ladder.flat", bad)
    bad.write_text("from ..auto.tune import resolve\n")
    test_rooms_import_only_their_own_room_or_rooms_before_it("spmd.ladder.flat", bad)  # auto is before the ladder...
    with pytest.raises(AssertionError, match="imports \\['spmd.auto.tune'\\]"):
        test_the_ladder_imports_nothing_from_ddp_sharding_or_auto("spmd.ladder.flat", bad)  # ...and still refused
    bad.write_text("from ..collectives import allreduce\n")  # transport/ cannot use what it carries
    with pytest.raises(AssertionError, match="room transport"):
        test_rooms_import_only_their_own_room_or_rooms_before_it("spmd.transport.p2p", bad)
    with pytest.raises(KeyError):
        room("spmd.pipeline.stages")  # a new room must be placed in the order before it is checked


# ---------------------------------------------------------------- the three maps of the engine agree

ARCHITECTURE = ROOT.parent / "ARCHITECTURE.md"


def listed_rooms(text: str) -> list[list[str]]:
    """The rooms a list names, in order: for each item ("- " or "3. ") whose head (the text before its first colon)
    is only names in backticks, those names, without `spmd/`."""
    found = []
    for line in text.splitlines():
        item = re.match(r"\s*(?:-|\d+\.)\s+((?:`[\w./]+`(?:,\s*|\s+and\s+)?)+):", line)
        if item:
            found.append([name.removeprefix("spmd/") for name in re.findall(r"`([\w./]+)`", item.group(1))])
    return found


def section(text: str, start: str, end: str) -> str:
    """The part of `text` from the line holding `start` to the next line holding `end`."""
    head = text.index(start)
    return text[head:text.index(end, head)]


def table_rooms(text: str) -> list[str]:
    """The room of each row of ARCHITECTURE.md's table of the engine's files, in the table's order."""
    rows = re.findall(r"^\| `spmd/([\w./]+)` \|", text, re.M)
    return [ROOM_OF[row.split("/")[0].removesuffix(".py")] for row in rows]


def check_maps(docstring: str, architecture: str) -> None:
    expected = list(MAP.values())
    listed = listed_rooms(section(docstring, "Rooms, in reading order", "\n\n"))
    assert listed == expected, f"spmd/__init__.py lists the rooms {listed}; tests/test_layout.py's MAP: {expected}"
    rooms_part = section(architecture, "## The engine's rooms", "| file |")
    listed = listed_rooms(rooms_part)
    assert listed == expected, f"ARCHITECTURE.md lists the rooms {listed}; tests/test_layout.py's MAP: {expected}"
    order = table_rooms(section(architecture, "| file |", "\n\n"))
    assert order == sorted(order, key=ROOMS.index) and set(order) == set(ROOMS), (
        f"ARCHITECTURE.md's table of the engine's files goes through the rooms in another order: {order}")


def test_the_three_maps_agree():
    check_maps(inspect.getdoc(importlib.import_module("manualdp.spmd")), ARCHITECTURE.read_text())
    on_disk = sorted(p.name + ("/" if p.is_dir() else "") for p in (ROOT / "spmd").iterdir()
                     if p.name not in ("__init__.py", "__pycache__"))
    assert on_disk == sorted(e for entries in MAP.values() for e in entries), "spmd/ holds what MAP does not name"


def test_the_map_checker_sees_a_disagreement():
    docstring = inspect.getdoc(importlib.import_module("manualdp.spmd"))
    architecture = ARCHITECTURE.read_text()
    check_maps(docstring, architecture)
    swapped = docstring.replace("- `ladder/`", "- `LADDER`").replace("- `ddp/`", "- `ladder/`").replace(
        "- `LADDER`", "- `ddp/`")
    with pytest.raises(AssertionError, match="spmd/__init__.py lists the rooms"):
        check_maps(swapped, architecture)
    without_ft = re.sub(r"\n\d+\. `ft/`:", "\nthen `ft/`:", architecture)
    with pytest.raises(AssertionError, match="ARCHITECTURE.md lists the rooms"):
        check_maps(docstring, without_ft)
    row = re.search(r"^\| `spmd/ft/manager.py` \|.*\n", architecture, re.M).group(0)
    moved_up = architecture.replace(row, "").replace("| `spmd/auto/pick.py`", row + "| `spmd/auto/pick.py`")
    with pytest.raises(AssertionError, match="table of the engine's files"):
        check_maps(docstring, moved_up)


@pytest.mark.parametrize("name, path", ENGINE, ids=lambda x: str(x) if isinstance(x, str) else "")
def test_engine_files_and_functions_stay_small(name, path):
    # a contributor fixing one corner has somewhere small to stand (issue 41): a file a role, a function a screen or two
    source = path.read_text()
    assert source.count("\n") <= 400, f"manualdp/{name.replace('.', '/')}.py has {source.count(chr(10))} lines (> 400)"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 80, f"{name}.{node.name} is {length} lines long (> 80)"


def test_the_size_check_sees_a_long_file_and_a_long_function(tmp_path):
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * 401)
    with pytest.raises(AssertionError, match="401 lines"):
        test_engine_files_and_functions_stay_small("spmd.big", big)
    big.write_text("def f():\n" + "    x = 1\n" * 81)
    with pytest.raises(AssertionError, match="spmd.big.f is 82 lines long"):
        test_engine_files_and_functions_stay_small("spmd.big", big)


@pytest.mark.parametrize("name, path", list(modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_no_private_name_is_imported_across_modules(name, path):
    for target, names in imports(name, path):
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{name} imports private {private} from {target}"


BOOK = [name for name, _ in modules() if layer(name) == "book" and name not in COMPAT]


@pytest.mark.parametrize("name", BOOK)
def test_book_modules_fit_a_sitting(name):
    lines = (ROOT / f"{name}.py").read_text().count("\n")
    assert lines <= 200, f"manualdp/{name}.py has {lines} lines; the book's rule is at most 200"


@pytest.mark.parametrize("fn", [manualdp.split_batch, manualdp.replicate, manualdp.allreduce, manualdp.broadcast,
                                manualdp.train_batch], ids=lambda f: f.__name__)
def test_book_functions_fit_on_one_screen(fn):
    source = inspect.getsource(fn)
    tree = ast.parse(source).body[0]
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body  # without the docstring
    lines = body[-1].end_lineno - body[0].lineno + 1
    assert lines <= 25, f"{fn.__name__} has a body of {lines} lines"


def test_the_package_has_no_benchmark_folder():
    # a pip-installed manualdp carries no QA harness: benchmarks live in bench/, beside the package
    # (a folder that a pull left holding only __pycache__ imports nothing: its modules are what count)
    assert [name for name, _ in modules() if "bench" in name] == []


def names_a_benchmark(module: str, handed_to_importlib: bool = False) -> bool:
    """Whether `module` is bench/ or the old manualdp.benchmarks (a bare "bench" string is just a word)."""
    return bool(re.fullmatch(r"(manualdp\.benchmarks|bench)(\.\w+)*", module)) and not (
        handed_to_importlib and module == "bench")


@pytest.mark.parametrize("name, path", list(modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_nothing_in_the_package_imports_the_benchmarks(name, path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names if names_a_benchmark(a.name)]
        elif isinstance(node, ast.ImportFrom):
            found = [node.module] if not node.level and names_a_benchmark(node.module or "") else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found = [node.value] if names_a_benchmark(node.value, handed_to_importlib=True) else []
        else:
            continue
        assert not found, f"{name} imports the benchmarks: {found}"


def test_the_benchmark_check_sees_an_import(tmp_path):
    bad = tmp_path / "cli.py"
    for line in ("import bench.faults", "from bench import faults", "from bench.common import save_outputs",
                 "importlib.import_module('manualdp.benchmarks.faults')", "importlib.import_module('bench.zero')"):
        bad.write_text(line + "\n")
        with pytest.raises(AssertionError, match="imports the benchmarks"):
            test_nothing_in_the_package_imports_the_benchmarks("runners.cli", bad)
    bad.write_text("if argv[0] == 'bench':\n    print('python bench/NAME.py')\n")
    test_nothing_in_the_package_imports_the_benchmarks("runners.cli", bad)


def loaded_after(code: str) -> list[str]:
    """The modules below `manualdp` that a fresh interpreter holds after running `code`."""
    code += "; import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.startswith('manualdp.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [m[len("manualdp."):] for m in json.loads(out.stdout.splitlines()[-1])]


@pytest.mark.parametrize("code", ["import manualdp.split", "from manualdp import split_batch, train_batch, allreduce"])
def test_importing_the_book_loads_the_book_only(code):
    loaded = loaded_after(code)
    assert {"split", "train", "allreduce"} <= set(loaded)
    beyond = [m for m in loaded if m in COMPAT or layer(m) not in ("book", "checks")]
    assert beyond == [], f"{code!r} loads {beyond}"  # spmd.peers among them would register the engine's exit hook


def test_the_rest_of_the_package_loads_when_first_used():
    loaded = loaded_after("import manualdp; manualdp.train; manualdp.History; "
                          "from manualdp.distributed import DistributedDataParallel")
    assert {"runners.loop", "support.history", "distributed", "spmd.ddp"} <= set(loaded)


@pytest.mark.parametrize("argv", [["faults.py", "--help"], ["scaling.py", "--help"],
                                  ["allreduce.py", "--spmd", "--help"]],
                         ids=lambda argv: argv[0])
def test_a_benchmark_runs_as_one_command_from_anywhere(argv, tmp_path):
    # `python bench/NAME.py` from another folder: the script finds bench.common and its siblings (scaling
    # runs compare_ddp's ranks, allreduce --spmd hands over to allreduce_spmd)
    script = ROOT.parent / "bench" / argv[0]
    out = subprocess.run([sys.executable, str(script), *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: bench/{argv[0]}"), out.stderr[-2000:]


def import_graph() -> dict[str, set[str]]:
    """Module -> the manualdp modules it imports (at any depth of the file), by their dotted names."""
    names = {name for name, _ in modules()}
    graph = {}
    for name, path in modules():
        edges = set()
        for target, taken in imports(name, path):
            named = [target or "__init__", *(f"{target}.{t}" if target else t for t in taken)]
            edges |= {m for m in named if m in names}
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
