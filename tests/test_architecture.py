"""The import rules of docs/ARCHITECTURE.md, checked on the source with ``ast``.

Every ``import`` statement counts, including those inside functions (lazy imports).

* core (``monitors``, ``detect``): torch and the standard library only -- no host framework, and
  nothing of ``session``, ``cli``, ``adapters``, ``research`` or ``testing``;
* ``session``: the core, no host framework, no ``cli`` / ``adapters`` / ``research`` / ``testing`` /
  ``calibrate``;
* ``cli``: the session (flags -> config), nothing else of the package;
* an adapter folder never imports another adapter folder; the one declared exception is
  ``megatron_lm`` -> the public entry point of ``megatron_core`` (Megatron-LM trains
  megatron-core models); the DeepSpeed adapter never imports megatron, the megatron adapters never
  import deepspeed;
* the product (everything but ``research`` and ``testing``) never imports ``research`` or ``testing``;
* ``plan`` (the planner): the core, the session, itself, torch and the standard library only;
* ``scan`` (mechmon-scan): its logic imports the core, the session and itself, no host framework,
  no checkpoint library; only its format readers (``scan/readers``) may import a host framework or
  ``safetensors``, each only its own (the DeepSpeed reader never imports megatron, no reader
  imports an adapter, ``cli`` or another reader's library).
* ``calibrate`` (mechmon-calibrate): the core, the session, itself, torch and the standard library;
  ``tensorboard`` (reading a run's events) and ``tqdm`` (the progress bar) as optional imports;
  never a host framework, ``research`` or ``testing`` (the studies import it, not the reverse).
* ``supervise`` (mechmon-supervise): the standard library, itself, three standard-library-only
  session modules (``session.alert``, ``session.webhook``, ``session.rollback_reach``) and the family table
  (``detect.families``); torch only as the optional ``torch.utils.tensorboard``; never torch.distributed, a
  host framework, ``research`` or ``testing``. Everything those imports load in turn (their packages'
  ``__init__`` included) is standard library only.

One more rule of the source: the detector's families are spelled in one place, ``detect/families.py``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mechmon_megatron"
PKG = "mechmon_megatron"
HOSTS = ("megatron", "deepspeed", "transformer_engine", "apex", "flash_attn")
ADAPTERS = ("megatron_core", "megatron_lm", "deepspeed")
ALLOWED_ADAPTER_IMPORTS = {"megatron_lm": f"{PKG}.adapters.megatron_core"}
"""adapter folder -> the one other adapter whose public entry point (its ``__init__``) it may import."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    return _parse_imports(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")


def _parse_imports(source: str, module: str, is_package: bool) -> list[str]:
    """Absolute names of every module ``source`` imports (``from a import b`` gives ``a`` and ``a.b``)."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def _files(*subpackages: str) -> list[Path]:
    roots = [PACKAGE / s for s in subpackages] if subpackages else [PACKAGE]
    files = []
    for root in roots:
        files += [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    return files


def _public_names(init: Path) -> set[str]:
    """The names in ``__all__`` of a package ``__init__``."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _violations(files: list[Path], forbidden) -> list[str]:
    return [f"{_module_name(f)} imports {name}" for f in files for name in _imports(f) if forbidden(f, name)]


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _own(sub: str) -> str:
    return f"{PKG}.{sub}"


PRODUCT = [f for f in _files() if not _under(_module_name(f), _own("research"), _own("testing"))]


def test_the_tree_has_the_layers_this_test_knows():
    for sub in ("monitors", "detect", "session", "cli", "plan", "research", "testing", "scan", "scan/readers",
                "supervise", "calibrate",
                *(f"adapters/{a}" for a in ADAPTERS)):
        assert (PACKAGE / sub / "__init__.py").is_file(), sub
    assert {p.name for p in (PACKAGE / "adapters").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ADAPTERS)


def test_core_imports_torch_and_itself_only():
    allowed_own = (_own("monitors"), _own("detect"))
    bad = _violations(
        _files("monitors", "detect"),
        lambda f, n: _under(n, *HOSTS) or (_under(n, PKG) and not _under(n, *allowed_own) and n != PKG),
    )
    assert not bad, bad


def test_session_imports_no_host_and_no_outer_layer():
    outer = (_own("cli"), _own("adapters"), _own("research"), _own("testing"), _own("calibrate"))
    bad = _violations(_files("session"), lambda f, n: _under(n, *HOSTS) or _under(n, *outer))
    assert not bad, bad


def test_cli_imports_the_session_only():
    bad = _violations(_files("cli"), lambda f, n: _under(n, *HOSTS) or _under(n, _own("adapters")))
    assert not bad, bad


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_no_adapter_imports_another(adapter):
    others = [_own(f"adapters.{a}") for a in ADAPTERS if a != adapter]
    foreign_host = ("megatron",) if adapter == "deepspeed" else ("deepspeed",)

    allowed: set[str] = set()
    if adapter in ALLOWED_ADAPTER_IMPORTS:
        entry = ALLOWED_ADAPTER_IMPORTS[adapter]
        init = PACKAGE.parent / entry.replace(".", "/") / "__init__.py"
        allowed = {entry} | {f"{entry}.{name}" for name in _public_names(init)}

    def forbidden(f: Path, name: str) -> bool:
        return _under(name, *foreign_host) or (_under(name, *others) and name not in allowed)

    bad = _violations(_files(f"adapters/{adapter}"), forbidden)
    assert not bad, bad


def test_plan_imports_core_session_torch_and_stdlib_only():
    own = (_own("monitors"), _own("detect"), _own("session"), _own("plan"))

    def forbidden(f: Path, name: str) -> bool:
        if _under(name, PKG):
            return not _under(name, *own)
        top = name.split(".")[0]
        return top != "torch" and top not in sys.stdlib_module_names

    bad = _violations(_files("plan"), forbidden)
    assert not bad, bad


CALIBRATE_OPTIONAL = ("tensorboard", "tqdm")
"""Third-party packages ``calibrate`` may import, each inside the function that needs it."""


def test_calibrate_imports_core_session_torch_and_stdlib_only():
    own = (_own("monitors"), _own("detect"), _own("session"), _own("calibrate"))

    def forbidden(f: Path, name: str) -> bool:
        if _under(name, PKG):
            return not _under(name, *own) and name != PKG
        top = name.split(".")[0]
        return top not in ("torch", *CALIBRATE_OPTIONAL) and top not in sys.stdlib_module_names

    bad = _violations(_files("calibrate"), forbidden)
    assert not bad, bad


SUPERVISE_SESSION_MODULES = (_own("session.alert"), _own("session.webhook"), _own("session.rollback_reach"))
"""The session modules the supervisor may import: each imports the standard library only."""
SUPERVISE_OTHER_MODULES = (_own("detect.families"),)
"""The family table (the remedy key of each detector family): standard library only."""


def _stdlib_or_own(name: str, own: tuple[str, ...]) -> bool:
    if _under(name, PKG):
        return _under(name, *own) or name in (PKG, _own("session"), _own("detect"))
    return name.split(".")[0] in sys.stdlib_module_names


def _module_file(name: str) -> Path | None:
    """The source file of a module of the package (None: an attribute, not a module)."""
    base = PACKAGE.parent / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _loaded_modules(roots: list[Path]) -> set[Path]:
    """Every file of the package that importing ``roots`` loads: what they import, the packages
    around each module (their ``__init__`` runs first), and so on."""
    seen: set[Path] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        module = _module_name(path)
        parents = [module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)]
        for name in [*_imports(path), *parents]:
            found = _module_file(name) if _under(name, PKG) else None
            if found is not None and found not in seen:
                todo.append(found)
    return seen


def test_supervise_imports_stdlib_three_session_modules_and_the_family_table_only():
    own = (_own("supervise"), *SUPERVISE_SESSION_MODULES, *SUPERVISE_OTHER_MODULES)
    bad = _violations(_files("supervise"),
                      lambda f, n: not (_stdlib_or_own(n, own) or _under(n, "torch.utils.tensorboard")))
    assert not bad, bad
    # What those modules load in turn (the detect package's __init__ with it) is standard library only.
    loaded = _loaded_modules(_files("supervise")) - set(_files("supervise"))
    assert {_module_name(f) for f in loaded} >= {*SUPERVISE_SESSION_MODULES, *SUPERVISE_OTHER_MODULES}
    bad = _violations(sorted(loaded), lambda f, n: not (_under(n, PKG) or n.split(".")[0] in sys.stdlib_module_names))
    assert not bad, bad


def test_product_never_imports_research_or_testing():
    bad = _violations(PRODUCT, lambda f, n: _under(n, _own("research"), _own("testing")))
    assert not bad, bad


SCAN_READER_LIBRARIES = {
    "torch_dist.py": (),  # torch.distributed.checkpoint only: no megatron needed to read torch_dist
    "megatron_legacy.py": (),
    "deepspeed_ckpt.py": (),  # plain torch.save files: neither deepspeed nor megatron
    "safetensors_hf.py": ("safetensors",),
}
"""Reader file -> the third-party checkpoint libraries it may import (besides torch)."""


def test_scan_logic_imports_core_and_session_only():
    own = (_own("monitors"), _own("detect"), _own("session"), _own("scan"))
    logic = [f for f in _files("scan") if "readers" not in f.relative_to(PACKAGE / "scan").parts]
    bad = _violations(
        logic,
        lambda f, n: _under(n, *HOSTS, "safetensors") or (_under(n, PKG) and not _under(n, *own) and n != PKG),
    )
    assert not bad, bad


def test_scan_readers_import_only_their_own_format_library():
    readers = _files("scan/readers")
    known = {f.name for f in readers} - {"__init__.py", "base.py", "layouts.py", "torch_files.py"}
    assert known == set(SCAN_READER_LIBRARIES), "declare the new reader's libraries in SCAN_READER_LIBRARIES"
    own = (_own("monitors"), _own("detect"), _own("session"), _own("scan"))

    def forbidden(f: Path, name: str) -> bool:
        allowed = SCAN_READER_LIBRARIES.get(f.name, ())
        foreign = [lib for lib in (*HOSTS, "safetensors") if lib not in allowed]
        return _under(name, *foreign) or (_under(name, PKG) and not _under(name, *own) and name != PKG)

    bad = _violations(readers, forbidden)
    assert not bad, bad


def test_the_rules_catch_a_violation():
    """The parser resolves relative and lazy imports (so the rules above are not vacuous)."""
    source = "def f():\n    from ..research import study\n    from . import names\n"
    names = _parse_imports(source, f"{PKG}.session.probe", is_package=False)
    assert f"{PKG}.research" in names and f"{PKG}.research.study" in names and f"{PKG}.session.names" in names
    assert _parse_imports("from .sites import x\n", f"{PKG}.adapters.deepspeed", True) == [
        f"{PKG}.adapters.deepspeed.sites", f"{PKG}.adapters.deepspeed.sites.x"]


# ---------------------------------------------------------------------------- the family table
FAMILY_TABLE = PACKAGE / "detect" / "families.py"
"""The one module that spells the detector's families (``FamilySpec``)."""


def family_spellings(source: str, families: frozenset[str]) -> list[str]:
    """``line: name`` of every string literal in ``source`` that is exactly a family name, when the
    source spells two or more families (a list of them, a table keyed by them, an enum of them);
    one name alone (a message, a single lookup) is not a list."""
    hits = [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in families]
    return [f"{line}: {name}" for line, name in sorted(hits)] if len({name for _, name in hits}) > 1 else []


def test_only_the_family_table_spells_the_families():
    """Every other module reads ``detect/families.py`` (the core detector, the session's inputs,
    start-up lines and flags, scan, the supervisor's policy): none spells the list again."""
    from mechmon_megatron.detect.families import FAMILY_NAMES

    families = frozenset(FAMILY_NAMES)
    bad = {_module_name(f): hits for f in PRODUCT if f != FAMILY_TABLE
           for hits in [family_spellings(f.read_text(encoding="utf-8"), families)] if hits}
    assert not bad, f"family names spelled outside {FAMILY_TABLE.name}; read the table instead: {bad}"
    assert family_spellings(FAMILY_TABLE.read_text(encoding="utf-8"), families)


def test_the_family_rule_catches_a_list():
    families = frozenset({"attn_delta2", "router_weights"})
    assert family_spellings('X = {"attn_delta2": 1, "router_weights": 2}\n', families) == [
        "1: attn_delta2", "1: router_weights"]
    assert family_spellings('def f(x):\n    return x == "attn_delta2"\n', families) == []


# ---------------------------------------------------------------------------- collectives
GUARD_MODULE = f"{PKG}.session.collective_guard"
"""The one module of the product that calls torch.distributed collectives (own groups, bounded wait)."""

COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "send_object_list", "recv_object_list", "all_reduce_coalesced",
})
"""torch.distributed functions that communicate (group creation and queries do not)."""

HOST_COLLECTIVES = frozenset({"force_param_sync", "start_param_sync", "read_full_param", "prefetch",
                              "safe_get_full_fp32_param", "GatheredParameters"})
"""Host functions that run a collective on the host's groups for the monitors (ZeRO reads, the
forced parameter all-gather): referenced only inside ``host_collective`` / ``run_host_collective``
arguments, or inside their own definitions."""

HOST_COLLECTIVE_RUNNERS = frozenset({"host_collective", "run_host_collective"})


def _distributed_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to the torch.distributed module, collective functions imported by name)."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                functions |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    return modules, functions


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def collective_calls(source: str) -> list[str]:
    """``line: call`` of every torch.distributed collective that ``source`` calls."""
    tree = ast.parse(source)
    modules, functions = _distributed_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            receiver = _dotted(func.value)
            if receiver in modules or receiver in ("torch.distributed", "torch.distributed.distributed_c10d") \
                    or receiver.endswith("._dist"):
                found.append(f"{node.lineno}: {_dotted(func)}")
        elif isinstance(func, ast.Name) and func.id in functions:
            found.append(f"{node.lineno}: {func.id}")
    return found


def unguarded_host_collectives(source: str) -> list[str]:
    """``line: name`` of every reference to a host collective outside a guard runner's arguments
    and outside its own definition."""
    tree = ast.parse(source)
    allowed: set[int] = set()
    for node in ast.walk(tree):
        inside = None
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name in HOST_COLLECTIVE_RUNNERS:
                inside = [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in HOST_COLLECTIVES:
            inside = node.body
        for part in inside or ():
            allowed |= {id(n) for n in ast.walk(part)}
    found = []
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name in HOST_COLLECTIVES and id(node) not in allowed:
            found.append(f"{node.lineno}: {name}")
    return found


def test_every_collective_goes_through_the_guard():
    """Only session/collective_guard.py calls torch.distributed collectives (mechmon's own groups,
    the bounded timeout, the down state, the byte counter); the host's collectives issued for the
    monitors run inside ``host_collective`` (the failure log and the schedule)."""
    bad = [f"{_module_name(f)}:{hit}" for f in PRODUCT if _module_name(f) != GUARD_MODULE
           for hit in collective_calls(f.read_text(encoding="utf-8"))]
    assert not bad, f"torch.distributed collectives outside {GUARD_MODULE}: {bad}"
    bad = [f"{_module_name(f)}:{hit}" for f in PRODUCT
           for hit in unguarded_host_collectives(f.read_text(encoding="utf-8"))]
    assert not bad, f"host collectives outside host_collective / run_host_collective: {bad}"
    assert collective_calls((PACKAGE / "session" / "collective_guard.py").read_text(encoding="utf-8"))


def test_the_collective_rule_catches_a_violation():
    """The detectors see every spelling of a collective call (so the rule above is not vacuous)."""
    source = ("import torch\nimport torch.distributed as dist\nfrom torch.distributed import all_gather as ag\n"
              "from torch import distributed\n"
              "def f(t, parts, g):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n    ag(parts, t)\n"
              "    distributed.broadcast_object_list([t], src=0)\n    self._dist.gather_object(t, None)\n"
              "    torch.gather(t, 0, t)\n    dist.get_rank(g)\n")
    assert [hit.split(": ")[1] for hit in collective_calls(source)] == [
        "dist.all_reduce", "torch.distributed.barrier", "ag", "distributed.broadcast_object_list",
        "self._dist.gather_object"]
    source = ("def g(s, chunks, router):\n    force_param_sync(chunks)\n"
              "    s.run_host_collective('read', 1, lambda: force_param_sync(chunks), 'w')\n"
              "    s.host_collective(router.prefetch, 'w')\n    router.prefetch()\n")
    assert unguarded_host_collectives(source) == ["2: force_param_sync", "5: prefetch"]
