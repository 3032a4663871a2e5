"""Process-group surgery in one audited room (issue 40): megarl.platform.process_groups.

Each piece works on the installed torch (a one-rank gloo world in this process), the private names
it relies on exist with the expected kind (a rename fails here, naming the name and the version it
was checked on), and nothing in megarl outside megarl/platform touches torch.distributed internals
or replaces an attribute of torch.distributed (the scan names the file and line).
"""
from __future__ import annotations

import ast
import gc
import inspect
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megarl.platform import process_groups
from megarl.platform.process_groups import CHECKED_ON

REPO = Path(__file__).resolve().parents[2]


def checked(what: str) -> str:
    return f"{what} (running torch {torch.__version__}; checked on torch {CHECKED_ON['torch']}, " \
           f"Megatron-Core {CHECKED_ON['megatron.core']}: see megarl/platform/process_groups.py)"


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world in this process (the existing one when a test before made it)."""
    from conftest import free_port

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield process_groups.get_default_group()
    if started:
        dist.destroy_process_group()


# --- the names relied on --------------------------------------------------------------------------

def test_the_private_names_exist_with_the_expected_kind():
    import torch.distributed.distributed_c10d as c10d

    for name, kind in process_groups.INTERNALS.items():
        assert hasattr(c10d, name), checked(f"torch.distributed.distributed_c10d.{name} is gone; expected {kind}")
    prop = getattr(type(c10d._world), "default_pg", None)
    assert isinstance(prop, property) and prop.fset is not None, \
        checked("torch.distributed.distributed_c10d._world.default_pg is no longer a settable property")
    assert hasattr(c10d._world, "pg_map"), checked("torch.distributed.distributed_c10d._world.pg_map is gone")
    for name in ("_get_default_group", "_get_default_store"):
        assert callable(getattr(c10d, name)) and not inspect.signature(getattr(c10d, name)).parameters, \
            checked(f"torch.distributed.distributed_c10d.{name} is no longer a function of no arguments")
    # group.WORLD (what torch.distributed's public calls default to) reads _world.default_pg
    meta = type(dist.group)
    assert isinstance(getattr(meta, "WORLD", None), property), checked("torch.distributed.group.WORLD is no longer a property")


def test_gloo_options_exist_and_a_bound_group_of_two_sends():
    """ProcessGroupGloo._Options with _devices and _timeout (GLOO_OPTIONS): gloo_group builds a group
    bound to 127.0.0.1 outside init_process_group, and bytes go across it."""
    import threading

    import torch

    for name, attrs in process_groups.GLOO_OPTIONS.items():
        options = getattr(dist.ProcessGroupGloo, name, None)
        assert options is not None, checked(f"torch.distributed.ProcessGroupGloo.{name} is gone")
        assert all(hasattr(options(), a) for a in attrs), checked(f"ProcessGroupGloo.{name} lacks one of {attrs}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    got = torch.zeros(4, dtype=torch.uint8)

    def peer():
        group = process_groups.gloo_group(dist.TCPStore("127.0.0.1", store.port), 1, 2, "127.0.0.1", 30.0)
        group.recv([got], 0, 0).wait()
    thread = threading.Thread(target=peer)
    thread.start()
    group = process_groups.gloo_group(store, 0, 2, "127.0.0.1", 30.0)
    group.send([torch.arange(4, dtype=torch.uint8)], 1, 0).wait()
    thread.join(timeout=30)
    assert got.tolist() == [0, 1, 2, 3]


def test_the_module_uses_no_private_name_it_does_not_declare():
    source = (REPO / "megarl/platform/process_groups.py").read_text()
    used = set(re.findall(r"c10d\.(_\w+)", source))
    assert used <= set(process_groups.INTERNALS), f"undeclared c10d internals {sorted(used - set(process_groups.INTERNALS))}: add them to INTERNALS"


@pytest.mark.parametrize("name", sorted(process_groups.PATCHED))
def test_the_patched_functions_take_the_parameters_the_replacements_pass(name):
    fn = getattr(dist, name, None)
    assert inspect.isfunction(inspect.unwrap(fn)) if fn is not None else False, \
        checked(f"torch.distributed.{name} is gone or no longer a plain function")
    params = list(inspect.signature(fn).parameters)  # follows __wrapped__ to torch's own function
    missing = [p for p in process_groups.PATCHED[name] if p not in params]
    assert not missing, checked(f"torch.distributed.{name}{inspect.signature(fn)} lacks {missing}")


@pytest.mark.parametrize("name", sorted(process_groups.DCP_PLANNER))
def test_the_checkpoint_planner_names_exist(name):
    from torch.distributed.checkpoint import default_planner

    obj = default_planner
    for part in name.split("."):
        obj = getattr(obj, part, None)
        assert obj is not None, checked(f"torch.distributed.checkpoint.default_planner.{name} is gone")
    params = list(inspect.signature(obj).parameters)
    assert params[:len(process_groups.DCP_PLANNER[name])] == list(process_groups.DCP_PLANNER[name]), \
        checked(f"torch.distributed.checkpoint.default_planner.{name}{inspect.signature(obj)} changed")


# --- each piece works ------------------------------------------------------------------------------

def test_default_group_swaps_the_world_and_restores_it(world, monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    other = dist.new_group([0])
    monkeypatch.setenv("RANK", "7")
    with process_groups.default_group(other, rank=0):
        assert dist.group.WORLD is other and c10d._get_default_group() is other, checked("the default-group swap had no effect")
        assert process_groups.get_default_group() is other and os.environ["RANK"] == "0"
        t = torch.ones(2)
        dist.all_reduce(t)  # a collective without a group runs on the swapped-in group
        assert t.tolist() == [1.0, 1.0]
    assert dist.group.WORLD is world and c10d._get_default_group() is world and os.environ["RANK"] == "7"

    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match="inside"):
        with process_groups.default_group(other, rank=3):
            assert os.environ["RANK"] == "3"
            raise RuntimeError("inside")
    assert dist.group.WORLD is world and "RANK" not in os.environ  # restored on an exception too

    with process_groups.default_group(other):  # no rank: RANK left alone
        assert dist.group.WORLD is other and "RANK" not in os.environ
    assert dist.group.WORLD is world


def test_set_default_group_is_for_good_and_returns_the_previous(world):
    other = dist.new_group([0])
    try:
        assert process_groups.set_default_group(other) is world
        assert dist.group.WORLD is other
    finally:
        assert process_groups.set_default_group(world) is other
    assert dist.group.WORLD is world


def test_stores(world):
    store = process_groups.default_store()
    assert isinstance(store, dist.Store) and store is process_groups.group_store(world), checked("the default store")
    store.set("megarl-test-key", "1")
    assert process_groups.group_store(world).get("megarl-test-key") == b"1"
    assert isinstance(process_groups.group_store(dist.new_group([0])), dist.Store)


def test_keep_default_group_keeps_the_world_and_restores_destroy(world):
    import torch.distributed.distributed_c10d as c10d

    real = dist.destroy_process_group
    sub = dist.new_group([0])
    with process_groups.keep_default_group():
        assert dist.destroy_process_group is not real
        dist.destroy_process_group()  # vLLM's last call: the default group survives
        assert dist.is_initialized() and dist.group.WORLD is world
        dist.destroy_process_group(sub)  # a named group is still destroyed
        assert sub not in c10d._world.pg_map, checked("destroy_process_group(group) under keep_default_group")
    assert dist.destroy_process_group is real
    with pytest.raises(RuntimeError, match="inside"):
        with process_groups.keep_default_group():
            raise RuntimeError("inside")
    assert dist.destroy_process_group is real  # restored on an exception too
    assert dist.is_initialized()


def _gloo_threads(at_most: int | None = None) -> int:
    """This process's gloo run-loop threads (2 per gloo group by default), once their number has settled
    (a destroyed group's threads end a moment later): within 5 s at most `at_most`, if given."""
    def count() -> int:
        names = []
        for task in Path("/proc/self/task").iterdir():
            try:
                names.append((task / "comm").read_text().strip())
            except OSError:  # the thread ended while listed
                pass
        return names.count("pt_gloo_runloop")

    deadline, last = time.monotonic() + 5, -1
    while time.monotonic() < deadline:
        now = count()
        if (at_most is not None and now <= at_most) or (at_most is None and now == last):
            return now
        last = now
        time.sleep(0.2)
    return count()


def test_a_layout_closed_inside_a_world_that_goes_on_destroys_the_groups_it_made(world):
    """A run opened inside an existing world (a test world, a user's launcher) must leave c10d as it found
    it: Megatron's destroy_model_parallel only drops its references, and each group kept its gloo threads
    (a test world's rank had 900 threads after a few hundred runs, most of its time in the kernel)."""
    from megarl.distributed.parallel import ParallelDims

    mine = dist.new_group([0])  # made before the layout: kept
    before, threads = process_groups.registered_groups(), _gloo_threads()
    dims = ParallelDims(world_size=1).initialize()
    made = len(process_groups.registered_groups() - before)
    assert made > 3 and _gloo_threads() > threads  # Megatron's groups, each with its threads
    dims.rollout_groups(1)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    for rotary in (RotaryEmbedding, YarnRotaryEmbedding):  # Megatron caches each module, and its cp group
        rotary(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(4)
        assert rotary.forward.cache_info().currsize > 0, rotary.__name__
    dims.destroy()
    assert [rotary.forward.cache_info().currsize for rotary in (RotaryEmbedding, YarnRotaryEmbedding)] == [0, 0]
    gc.collect()
    assert process_groups.registered_groups() == before, checked("c10d._world.pg_map after ParallelDims.destroy (destroy_groups)")
    assert _gloo_threads(at_most=threads) <= threads  # Megatron's globals reset, its two forgotten ones too (fewer: the
    # collection may also free what an earlier test of this process left)
    assert mine in process_groups.registered_groups() and world in process_groups.registered_groups()
    dist.destroy_process_group(mine)
    assert process_groups.destroy_groups_since(process_groups.registered_groups()) == 0  # nothing new: nothing destroyed


def test_all_reduce_is_installed_and_uninstalled(world, monkeypatch):
    # start from torch's own all_reduce whatever an earlier test installed; monkeypatch puts it all back
    real = process_groups._REAL_ALL_REDUCE or dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", real)
    monkeypatch.setattr(process_groups, "_REAL_ALL_REDUCE", None)
    calls = []

    def wrap(original):
        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            calls.append(group)
            return original(tensor, op=op, group=group, async_op=async_op)

        all_reduce.__wrapped__ = original
        return all_reduce

    process_groups.install_all_reduce(wrap)
    assert process_groups.all_reduce_installed() and dist.all_reduce is not real and dist.all_reduce.__wrapped__ is real
    t = torch.ones(1)
    dist.all_reduce(t, group=world)
    assert calls == [world] and t.tolist() == [1.0]
    with pytest.raises(RuntimeError, match="already replaced"):
        process_groups.install_all_reduce(wrap)
    process_groups.uninstall_all_reduce()
    assert dist.all_reduce is real and not process_groups.all_reduce_installed()
    process_groups.uninstall_all_reduce()  # nothing installed: nothing to do
    assert dist.all_reduce is real



def test_solo_groups_installs_through_the_platform(world):
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from megarl.engine import solo_groups

    was = solo_groups._INSTALLED
    solo_groups.uninstall()  # from the state before any install (an earlier test's engine installs it)
    real = dist.all_reduce
    names = ("dist_all_gather_func", "dist_reduce_scatter_func")
    originals = {n: getattr(buffers, n) for n in names if hasattr(buffers, n)}
    assert not process_groups.all_reduce_installed()
    try:
        solo_groups.install()
        assert process_groups.all_reduce_installed() and dist.all_reduce.__wrapped__ is real
        assert dist.all_reduce(torch.ones(1), group=world) is None  # a group of one issues nothing
        assert all(getattr(buffers, n).__wrapped__ is f for n, f in originals.items())
        solo_groups.uninstall()
        assert dist.all_reduce is real and all(getattr(buffers, n) is f for n, f in originals.items())
    finally:
        if was:
            solo_groups.install()


def test_all_gather_object_over_one_rank_issues_nothing(monkeypatch):
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("a collective over a group of one"))
    assert process_groups.all_gather_object({"a": 1}, 1, None) == [{"a": 1}]


def test_dcp_load_bytes_is_replaced_and_restored():
    from torch.distributed.checkpoint import default_planner

    real = default_planner.DefaultLoadPlanner.load_bytes

    def load_bytes(self, read_item, value):
        pass

    with pytest.raises(RuntimeError, match="inside"):
        with process_groups.dcp_load_bytes(load_bytes):
            assert default_planner.DefaultLoadPlanner.load_bytes is load_bytes
            raise RuntimeError("inside")
    assert default_planner.DefaultLoadPlanner.load_bytes is real
    root: dict = {}
    process_groups.dcp_set_element(root, ("a", "b"), 3)
    assert root == {"a": {"b": 3}}


# --- nowhere else ----------------------------------------------------------------------------------

# Private names of torch.distributed, whatever object they are reached through.
PRIVATE_NAMES = {"distributed_c10d", "_world", "_all_gather_object", "_get_default_group", "_get_default_store",
                 "_store", "default_pg", "pg_map", "_update_default_pg", "_traverse"}
_PRIVATE_TEXT = re.compile(r"distributed_c10d|c10d\._|torch\.distributed\.(\w+\.)*_[a-z]")
_PATCHERS = {"setattr", "delattr"}


class _Scan(ast.NodeVisitor):
    """Uses of torch.distributed internals and replacements of torch.distributed attributes in one file."""

    def __init__(self, path: str, lines: list[str]):
        self.path, self.lines, self.found = path, lines, []
        self.modules: dict[str, str] = {}  # local name -> the torch module it is (torch, torch.distributed, ...)

    def flag(self, node, why: str):
        self.found.append(f"{self.path}:{node.lineno}: {why}: {self.lines[node.lineno - 1].strip()}")

    def dist_path(self, node) -> str | None:
        """The dotted name of `node` when it is torch.distributed or something inside it."""
        if isinstance(node, ast.Name):
            path = self.modules.get(node.id)
        elif isinstance(node, ast.Attribute):
            base = self.dist_path(node.value) or self.torch_path(node.value)
            path = f"{base}.{node.attr}" if base else None
        else:
            return None
        return path if path and (path == "torch.distributed" or path.startswith("torch.distributed.")) else None

    def torch_path(self, node) -> str | None:
        return self.modules.get(node.id) if isinstance(node, ast.Name) and self.modules.get(node.id) == "torch" else None

    def visit_Import(self, node):
        for a in node.names:
            if a.name == "torch" or a.name.startswith("torch."):
                self.modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
            self.check_module(node, a.name)
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        mod = node.module or ""
        self.check_module(node, mod)
        for a in node.names:
            if mod.startswith("torch"):
                self.modules[a.asname or a.name] = f"{mod}.{a.name}"
                if mod.startswith("torch.distributed") and (a.name.startswith("_") or a.name in PRIVATE_NAMES):
                    self.flag(node, f"imports the private {mod}.{a.name}")
            elif a.name in PRIVATE_NAMES or (a.asname or "") in PRIVATE_NAMES:
                self.flag(node, f"imports {a.name}")
        self.generic_visit(node)

    def check_module(self, node, mod: str):
        parts = mod.split(".")
        if mod.startswith(("torch.distributed", "torch._C._distributed")) and any(
                p.startswith("_") or p in PRIVATE_NAMES for p in parts[1:]):
            self.flag(node, f"imports the private module {mod}")

    def visit_Attribute(self, node):
        base = self.dist_path(node.value)
        if node.attr in PRIVATE_NAMES:
            self.flag(node, f"uses the private name {node.attr}")
        elif base and node.attr.startswith("_") and not node.attr.startswith("__"):
            self.flag(node, f"uses the private {base}.{node.attr}")
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in PRIVATE_NAMES:
            self.flag(node, f"uses the private name {node.id}")

    def visit_FunctionDef(self, node):
        if node.name in PRIVATE_NAMES:
            self.flag(node, f"defines {node.name}")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def check_target(self, target):
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self.check_target(t)
        elif isinstance(target, ast.Starred):
            self.check_target(target.value)
        elif isinstance(target, ast.Attribute) and self.dist_path(target.value):
            self.flag(target, f"replaces {self.dist_path(target.value)}.{target.attr}")

    def visit_Assign(self, node):
        for target in node.targets:
            self.check_target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self.check_target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self.check_target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for target in node.targets:
            self.check_target(target)
        self.generic_visit(node)

    def visit_Call(self, node):
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        if node.args:
            first = node.args[0]
            if (name in _PATCHERS or name == "object") and self.dist_path(first):
                self.flag(node, f"{name} on {self.dist_path(first)}")
            if name in ("patch", "setattr") and isinstance(first, ast.Constant) and str(first.value).startswith("torch.distributed"):
                self.flag(node, f"{name} of {first.value}")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and _PRIVATE_TEXT.search(node.value) and "\n" not in node.value:
            self.flag(node, "names a torch.distributed internal in a string")


def surgery_outside_platform(root: Path) -> list[str]:
    """Every use of a torch.distributed internal and every replacement of a torch.distributed
    attribute in root/megarl outside root/megarl/platform, as 'path:line: why: source'."""
    found = []
    for path in sorted((root / "megarl").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("megarl/platform/"):
            continue
        text = path.read_text()
        scan = _Scan(rel, text.splitlines())
        scan.visit(ast.parse(text, filename=rel))
        found += scan.found
    return found


def test_no_process_group_surgery_outside_the_platform():
    found = surgery_outside_platform(REPO)
    assert not found, ("torch.distributed internals or patches outside megarl/platform (move them into "
                       "megarl/platform/process_groups.py, with the reason and the versions checked):\n" + "\n".join(found))


def test_the_scan_finds_each_kind_of_surgery(tmp_path):
    bad = tmp_path / "megarl" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "import torch.distributed.distributed_c10d as c10d\n"
        "from torch.distributed.distributed_c10d import _get_default_store\n"
        "from megarl.hybrid.dispatch import _all_gather_object\n"
        "c10d._world.default_pg = None\n"
        "dist.all_reduce = print\n"
        "torch.distributed.destroy_process_group = print\n"
        "setattr(dist, 'new_group', print)\n"
        "x = dist._coalescing_manager\n"
        "from torch.distributed.checkpoint import default_planner\n"
        "default_planner.DefaultLoadPlanner.load_bytes = print\n"
        "a, dist.new_group = 1, print\n"
        "ok = dist.get_rank()\n"
    )
    found = surgery_outside_platform(tmp_path)
    lines = {int(f.split(":")[1]) for f in found}
    assert lines == {3, 4, 5, 6, 7, 8, 9, 10, 12, 13}, "\n".join(found)
    assert all(f.startswith("megarl/bad.py:") for f in found)


def test_the_module_stands_on_the_ground_floor():
    """megarl.platform imports nothing from higher megarl packages: process_groups only torch and the standard library."""
    tree = ast.parse((REPO / "megarl/platform/process_groups.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    higher = sorted(m for m in imported if m.startswith("megarl") and not m.startswith("megarl.platform"))
    assert not higher, f"megarl/platform/process_groups.py imports {higher}"
