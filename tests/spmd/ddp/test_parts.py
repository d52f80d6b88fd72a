"""The drop-in is rung 4's bucket plus flags, and features, each in a file of its own that uses only the reducer's
public names."""
import ast
import pathlib
import re

import pytest
import torch

import manualdp

SPMD = pathlib.Path(manualdp.__file__).parent / "spmd" / "ddp"
CORE = ("wrapper.py", "reducer.py", "bucket.py", "feature.py")  # the wrapper, the reducer, its bucket, a feature
FEATURES = sorted(p.name for p in SPMD.glob("*.py") if p.name not in CORE + ("__init__.py",))
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
    assert all((SPMD / name).exists() for name in CORE)
    assert FEATURES == sorted(["join.py", "comm_hook.py", "hook_identity.py", "graph.py", "step_check.py", "buffers.py",
                               "private.py", "init_sync.py"])


def test_rung_5s_bucket_is_rung_4s_plus_flags():
    from manualdp.spmd.ddp.bucket import FlaggedBucket
    from manualdp.spmd.ladder.bucket import Bucket
    assert issubclass(FlaggedBucket, Bucket)
    p, q = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))
    plain, flagged = Bucket([p, q]), FlaggedBucket([p, q])
    assert plain.flat.numel() == 10 and flagged.flat.numel() == 10 + 2 * 2  # a used and a ready flag each
    assert flagged.mark_ready(1, torch.full((4,), 2.0)) is False and flagged.mark_ready(0, None) is True
    flagged.seal()
    assert flagged.used.tolist() == [0, 1] and flagged.ready.tolist() == [1, 1]
    assert torch.equal(flagged.grads, torch.cat([torch.zeros(6), torch.full((4,), 2.0)]))
    with pytest.raises(RuntimeError, match="arrived twice"):
        flagged.mark_ready(1, torch.ones(4))


def test_the_reducer_calls_the_features_hooks_in_the_order_of_the_wrappers_list():
    from manualdp.spmd.ddp.feature import HOOKS, Feature
    from manualdp.spmd.ddp.reducer import Reducer
    calls = []

    class Named(Feature):
        def __init__(self, name):
            self.name = name

        def before_reduce(self, index, bucket):
            calls.append((self.name, index))

    class Silent(Feature):  # overrides nothing: never called
        pass

    reducer = Reducer.__new__(Reducer)
    reducer.use([Named("b"), Silent(), Named("a")])
    assert set(reducer.feature_hooks) == set(HOOKS)
    assert reducer.feature_hooks["grad_ready"] == [] and len(reducer.feature_hooks["before_reduce"]) == 2
    for fn in reducer.feature_hooks["before_reduce"]:
        fn(3, None)
    assert calls == [("b", 3), ("a", 3)]


def test_the_wrapper_hands_the_reducer_every_feature_that_hooks_into_a_step():
    source = (SPMD / "wrapper.py").read_text()
    wire = source[source.index("def _wire"):source.index("def __getstate__")]
    listed = wire[wire.index("r.use(["):]
    for feature in ("self.calls", "Desync(", "self.buffer_sync", "self.graph"):
        assert feature in listed, f"{feature} is not in the wrapper's list of features"


@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_reads_no_private_name_of_the_wrapper_or_the_reducer(feature):
    private = set().union(*(_private_names(name) for name in CORE if (SPMD / name).exists()))
    assert private  # the scan finds what it looks for
    read = set()
    for node in ast.walk(_tree(feature)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            read.add(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in ("wrapper", "reducer", "bucket"):
            read.update(f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_"))
    assert not read, f"{feature} reads private names of wrapper.py/reducer.py: {sorted(read)}"


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
    assert lines <= 300, f"spmd/ddp/{name} has {lines} lines"
