"""Rules of the house a reader relies on (issue 29), checked on the source: the run's life has one
room (megarl/run.py), long modules say why they are long, and the model families have one list."""
from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LONG_LINES = 400  # STYLE.md habit 9: past about 400 lines a file says, in its docstring, why


def _python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def _names_used(tree: ast.AST) -> set[str]:
    """Every name a module reads, calls or imports, less those it defines (the owner of a mechanism
    may use it: checkpoint_io.py raises its own RunDirLocked)."""
    used, defined = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used.update(alias.name for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
    return used - defined


# The run-directory lock, the resume decision and what goes with it (the config-change check, the
# segment record, moving an abandoned trajectory's checkpoints aside). Their definitions live in
# checkpoint_io.py / resume_changes.py; only megarl/run.py may use them.
RUN_LIFE = {"RunDirLock", "RunDirLocked", "check_resume", "record_segment", "abandon_newer", "remove_leftovers",
            "resume_point", "_resume_point"}


def test_only_megarl_run_takes_the_lock_or_decides_where_to_resume():
    run_py = REPO / "megarl" / "run.py"
    assert RUN_LIFE - {"resume_point", "_resume_point"} <= _names_used(ast.parse(run_py.read_text()))
    offenders = {}
    for path in _python_files("megarl", "launch"):
        if path == run_py:
            continue
        text = path.read_text()
        if not any(name in text for name in RUN_LIFE):
            continue  # (parsing only the files that mention one keeps this test under a second)
        used = _names_used(ast.parse(text)) & RUN_LIFE
        if used:
            offenders[path.relative_to(REPO).as_posix()] = sorted(used)
    assert not offenders, f"the run's life belongs to megarl/run.py; also handled in: {offenders}"


def test_the_launch_script_reads_at_a_glance():
    lines = (REPO / "launch" / "ppo.py").read_text().splitlines()
    assert len(lines) < 50, f"launch/ppo.py has {len(lines)} lines: the run's policy belongs in megarl/run.py"


def test_long_modules_say_why_they_are_long():
    """A module past LONG_LINES lines has a sentence with 'long because' in its docstring."""
    silent = []
    for path in _python_files("megarl"):
        text = path.read_text()
        n = len(text.splitlines())
        if n > LONG_LINES and "long because" not in (ast.get_docstring(ast.parse(text)) or ""):
            silent.append(f"{path.relative_to(REPO).as_posix()} ({n} lines)")
    assert not silent, (f"past {LONG_LINES} lines without a docstring sentence saying why it is long "
                        f"('... is long because ...'), or split it by what it owns: {', '.join(silent)}")


def test_the_families_have_one_list():
    """megarl.models.families.FAMILY_NAMES feeds the builder, make_tiny_model, the config, the tests'
    fixtures; docs/models.md's table names the same families in the same order."""
    from conftest import FAMILIES as TEST_FAMILIES
    from conftest import FAMILIES_671B
    from megarl.config.inputs import TINY_MOE_ARCHS
    from megarl.config.schema import MakeTinyConfig
    from megarl.models import families
    from megarl.tools.make_tiny_model import ARCHS, _parser

    names = families.FAMILY_NAMES
    assert names == ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe")
    assert tuple(families.FAMILIES) == names and ARCHS == names
    assert TEST_FAMILIES + FAMILIES_671B == names
    assert set(TINY_MOE_ARCHS) == set(names) - set(families.DENSE_FAMILIES)
    arch_choices = next(a.choices for a in _parser()._actions if a.dest == "arch")
    assert tuple(arch_choices) == names
    assert typing.get_args(typing.get_type_hints(MakeTinyConfig)["arch"]) == families.DENSE_FAMILIES + families.MOE_FAMILIES
    table = (REPO / "docs" / "models.md").read_text().split("## Supported families", 1)[1].split("\n#", 1)[0]
    assert tuple(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))[1:] == names  # [0]: the header, `model_type`


# Lists that name families for a reason of their own, not as a copy of the family list: the
# families the direct vLLM weight path covers (today the dense ones; megarl/rollout/ is another
# engineer's area in the session that added this test, so it is named here rather than rewritten).
OWN_FAMILY_LISTS = {"megarl/rollout/vllm_direct.py": {("llama", "qwen2", "qwen3")}}


def test_no_other_module_spells_out_a_list_of_families():
    """A tuple, list or set of two or more family names written out in megarl/ outside
    megarl/models/families.py is a second family list: read it from families.py instead."""
    from megarl.models.families import FAMILY_NAMES

    copies = {}
    for path in _python_files("megarl"):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text()
        if rel == "megarl/models/families.py" or sum(f'"{n}"' in text for n in FAMILY_NAMES) < 2:
            continue  # (parsing only the files that quote two names keeps this test under a second)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and e.value in FAMILY_NAMES for e in node.elts):
                names = tuple(e.value for e in node.elts)
                if names not in OWN_FAMILY_LISTS.get(rel, set()):
                    copies.setdefault(rel, []).append(f"line {node.lineno}: {names}")
    assert not copies, f"family names listed outside megarl/models/families.py: {copies}"
