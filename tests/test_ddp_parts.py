"""The drop-in is rung 4's reducer plus features, each in a file of its own that uses only the reducer's public names."""
import ast
import pathlib
import re

import pytest

import manualdp

SPMD = pathlib.Path(manualdp.__file__).parent / "spmd"
CORE = ("ddp.py", "reducer.py", "bucket.py")  # the wrapper, the reducer and its bucket
FEATURES = sorted(p.name for p in SPMD.glob("ddp_*.py"))
OWNED = sorted(set(CORE) | set(FEATURES))  # this part's files (the line count below is held for these)


def _tree(name: str) -> ast.Module:
    return ast.parse((SPMD / name).read_text())


def _private_names(name: str) -> set[str]:
    """Private names of the wrapper and the reducer: `self._x = ...`, `_x` defined in a class, module-level `_x`."""
    names = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_the_split_has_its_files():
    assert (SPMD / "reducer.py").exists()
    assert {"ddp_join.py", "ddp_hooks.py", "ddp_checks.py", "ddp_debug.py", "ddp_buffers.py",
            "ddp_private.py"} <= set(FEATURES)


@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_reads_no_private_name_of_the_wrapper_or_the_reducer(feature):
    private = set().union(*(_private_names(name) for name in CORE if (SPMD / name).exists()))
    assert private  # the scan finds what it looks for
    read = set()
    for node in ast.walk(_tree(feature)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            read.add(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in ("ddp", "reducer", "bucket"):
            read.update(f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_"))
    assert not read, f"{feature} reads private names of ddp.py/reducer.py: {sorted(read)}"


def _public_surface() -> set[str]:
    """The names the reducer's docstring offers to features (in backticks, call parentheses dropped)."""
    doc = ast.get_docstring(_tree("reducer.py"))
    offered = doc[doc.index("What a feature may read or call"):]
    return {re.sub(r"\(.*", "", n) for n in re.findall(r"`([A-Za-z_][^`]*)`", offered)}


@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_uses_only_what_the_reducers_docstring_offers(feature):
    offered = _public_surface()
    used = set()
    for node in ast.walk(_tree(feature)):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value  # `self.reducer.x`, `reducer.x`, or `r.x` after `r = self.reducer`
        if (isinstance(holder, ast.Attribute) and holder.attr == "reducer") or \
                (isinstance(holder, ast.Name) and holder.id in ("reducer", "r")):
            used.add(node.attr)
    assert used <= offered, f"{feature} uses reducer names its docstring does not offer: {sorted(used - offered)}"


@pytest.mark.parametrize("name", OWNED)
def test_each_file_of_the_drop_in_is_under_300_lines(name):
    lines = len((SPMD / name).read_text().splitlines())
    assert lines <= 300, f"spmd/{name} has {lines} lines"
