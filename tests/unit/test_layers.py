"""Imports point down the layers of DESIGN.md §4, no module imports itself in a circle,
and only ``baft.cli`` parses arguments.

A small AST pass over every module under ``baft/`` (no dependency: grimp/import-linter
would do the same graph, but the check is ~100 lines and has to know the repository's
own rules anyway). Every import counts: top level, inside functions, under
``TYPE_CHECKING``, and ``importlib.import_module("baft....")`` with a literal name.

``KNOWN_VIOLATIONS`` lists the (importer, imported) pairs that break a rule today. The
test fails when a pair not in it appears and when one in it no longer occurs, so the set
can only shrink: when you fix one, delete its line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "baft"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("demo",),
    ("train",),
    ("integrations",),
    ("<face>",),
    ("inprocess",),
    ("api",),
    ("recover",),
    ("engine",),
    ("liveness",),
    ("pipeline", "model"),
    ("sim", "faults", "config"),
    ("store", "profile"),
    ("plan", "topology"),
    ("errors",),
)
"""Top to bottom, as in DESIGN.md §4 ("Imports only point down the list's layers"): a
module may import its own layer and the layers below. Names are the first component
under ``baft.``; ``<face>`` is ``baft/__init__.py``, the public face, which may import
only ``api``, ``config`` and ``inprocess`` (``baft.run``) (``FACE_MAY_IMPORT``) and sits
above the library it exposes. ``inprocess`` (in-process recovery: the supervisor around
the training process, and ``baft.run`` inside it) wraps the library the script uses; the
library reads it only through ``liveness.generation``.
``integrations`` (optional framework adapters, e.g. torchtitan's checkpoint manager) sit
on the library as a user does. ``liveness`` (watchdog, SIGTERM, DataLoader workers through
a SIGTERM) imports nothing of baft above it; it sits right under its lowest user, the
engine (api, recover and inprocess use it too).
``errors`` (the refusal marker) is imported from every layer and imports nothing."""

FACE_MAY_IMPORT = frozenset({"api", "config", "inprocess"})
ARGPARSE_ONLY_IN = "cli"
"""All argument parsing lives in ``baft/cli/`` (DESIGN.md §4)."""

KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()
"""(importer, imported) pairs that break a rule today. Only ever delete lines."""

LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}

RECOVER_MAY_IMPORT_FROM_ENGINE = frozenset({"baft.engine.transport"})
"""Recovery runs against a stated interface (``baft.recover.restorable.Restorable``): of
the engine it imports the transport seam alone."""
RECOVER_ENGINE_PENDING: frozenset[str] = frozenset()
"""Engine modules recovery still imports until they move. Only ever delete lines."""


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``baft/``."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported_names(module: str, path: Path) -> Iterator[str]:
    """Every dotted name an import statement (or literal import_module) in the file names;
    ``from a import b`` yields ``a.b``, resolved to ``a`` later when ``b`` is no module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> baft modules it imports, module -> third-party top-level names)."""
    files = module_files()
    internal: dict[str, set[str]] = {m: set() for m in files}
    external: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for name in _imported_names(module, path):
            if name != "baft" and not name.startswith("baft."):
                external[module].add(name.split(".")[0])
                continue
            while name not in files:  # "from pkg import attr": the module is pkg
                name = name.rpartition(".")[0]
            if name != module:
                internal[module].add(name)
    return internal, external


def layer_name(module: str) -> str:
    return "<face>" if module == "baft" else module.split(".")[1]


def climbs(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports from a layer to one above it (and from the face beyond api/config)."""
    out = set()
    for importer, imported in ((a, b) for a, bs in graph.items() for b in bs):
        src, dst = layer_name(importer), layer_name(imported)
        if src == "<face>":
            bad = dst not in FACE_MAY_IMPORT
        else:
            bad = LAYER_OF[dst] < LAYER_OF[src]
        if bad:
            out.add((importer, imported))
    return out


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.add(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def violations() -> dict[tuple[str, str], list[str]]:
    """Every rule break as (importer, imported) -> the rules it breaks."""
    graph, external = import_graph()
    out: dict[tuple[str, str], list[str]] = {}
    for a, b in climbs(graph):
        why = (
            f"the public face (baft/__init__.py) may import only {sorted(FACE_MAY_IMPORT)}"
            if a == "baft"
            else f"climbs from {layer_name(a)} up to {layer_name(b)}"
        )
        out.setdefault((a, b), []).append(why)
    for comp in cycles(graph):
        circle = ", ".join(sorted(comp))
        for a in sorted(comp):
            for b in sorted(graph[a] & comp):
                out.setdefault((a, b), []).append(f"import circle among {{{circle}}}")
    for module, names in external.items():
        if "argparse" in names and layer_name(module) != ARGPARSE_ONLY_IN:
            out.setdefault((module, "argparse"), []).append("argument parsing outside baft/cli")
    return out


def test_every_package_has_a_layer() -> None:
    unplaced = sorted({layer_name(m) for m in module_files()} - set(LAYER_OF))
    assert not unplaced, f"add {unplaced} to LAYERS in {__file__} (see DESIGN.md §4)"


def test_imports_point_down_without_circles() -> None:
    found = violations()
    new = sorted(set(found) - KNOWN_VIOLATIONS)
    gone = sorted(KNOWN_VIOLATIONS - set(found))
    lines = [f"  {a} imports {b}: {'; '.join(found[(a, b)])}" for a, b in new]
    if lines:
        order = " -> ".join("/".join(names) for names in LAYERS)
        lines.insert(0, f"new import violations (DESIGN.md §4, top to bottom: {order}):")
    if gone:
        lines.append("fixed, so delete from KNOWN_VIOLATIONS in tests/unit/test_layers.py:")
        lines += [f"  {pair!r}," for pair in gone]
    assert not lines, "\n".join(lines)


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A climb in a function, one under TYPE_CHECKING, a relative one and a literal
    import_module are all found; an attribute import resolves to its module."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "from . import coordinator\n"
        "from baft.plan import types\n"
        "if TYPE_CHECKING:\n"
        "    from baft.engine.engine import CheckpointEngine\n"
        "def f():\n"
        "    from baft.train.worker import main\n"
        "    importlib.import_module('baft.cli')\n"
    )
    path = tmp_path / "fake.py"
    path.write_text(source)
    names = set(_imported_names("baft.recover.fake", path))
    assert {
        "baft.recover.coordinator",
        "baft.plan.types",
        "baft.engine.engine.CheckpointEngine",
        "baft.train.worker.main",
        "baft.cli",
    } <= names
    graph = {
        "baft.recover.fake": {"baft.train.worker", "baft.engine.engine", "baft.plan.types"},
        "baft.train.worker": {"baft.recover.fake"},
        "baft.engine.engine": set(),
        "baft.plan.types": set(),
    }
    assert climbs(graph) == {("baft.recover.fake", "baft.train.worker")}
    assert cycles(graph) == [{"baft.recover.fake", "baft.train.worker"}]
    face = {"baft": {"baft.api", "baft.config", "baft.plan.types"}, "baft.api": {"baft"}}
    assert climbs(face) == {("baft", "baft.plan.types"), ("baft.api", "baft")}


def test_recover_imports_only_the_transport_seam_from_the_engine() -> None:
    graph, _ = import_graph()
    found = {
        b
        for a, bs in graph.items()
        if layer_name(a) == "recover"
        for b in bs
        if layer_name(b) == "engine"
    }
    extra = sorted(found - RECOVER_MAY_IMPORT_FROM_ENGINE - RECOVER_ENGINE_PENDING)
    assert not extra, (
        f"baft.recover imports {extra} from baft.engine: state what recovery needs in "
        "baft/recover/restorable.py, or move the code below the engine"
    )
    gone = sorted(RECOVER_ENGINE_PENDING - found)
    assert not gone, f"no longer imported, so delete from RECOVER_ENGINE_PENDING: {gone}"


PROCESS_STATE_MAY_LIVE_IN = ("baft.inprocess", "baft.liveness.generation")
"""Where module-level state that changes at run time may live: in-process recovery owns
the process around the library (its channel, the generation's members)."""
_CONTAINERS = {"dict", "list", "set", "WeakSet", "WeakValueDictionary", "WeakKeyDictionary"}


def _module_state(path: Path) -> Iterator[str]:
    """``global`` statements, and module-level names bound to an empty container (a
    registry filled at run time), in one file."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            yield f"line {node.lineno}: global {', '.join(node.names)}"
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        empty_literal = isinstance(value, ast.Dict | ast.List | ast.Set) and not (
            getattr(value, "keys", None) or getattr(value, "elts", None)
        )
        empty_call = (
            isinstance(value, ast.Call)
            and not value.args
            and ast.unparse(value.func).rpartition(".")[2] in _CONTAINERS
        )
        if empty_literal or empty_call:
            yield f"line {node.lineno}: {ast.unparse(node)[:60]}"


def test_no_module_level_mutable_state_outside_inprocess() -> None:
    """A process-wide singleton outside in-process recovery is state the next reader
    cannot see being wired: pass it at construction instead (issue: construct whole)."""
    found = [
        f"{module} {where}"
        for module, path in module_files().items()
        if not module.startswith(PROCESS_STATE_MAY_LIVE_IN)
        for where in _module_state(path)
    ]
    assert not found, found


def test_the_module_state_check_sees_globals_and_registries(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "import weakref\n_A = {}\n_B = weakref.WeakSet()\nC = (1,)\n"
        "def f():\n    global _x\n    _x = 1\n"
    )
    assert [w.split(":")[0] for w in _module_state(path)] == ["line 6", "line 2", "line 3"]
