"""The runtime package's structure: imports only run down the layers docs/architecture.md
declares (the driver side, ``runtime.launch``, above the per-worker loop, ``runtime.train``), no
import cycles, one module that builds storage paths, no module that imports another's private
names, no module over 400 lines without its docstring saying why (test files under tests/ too),
and ``Trainer.fit`` short enough to read at a glance.

The checks read the source with ast (nothing is imported, so no import side effects).
Imports inside functions count too: a lazy import that closes a cycle hides it, it does not
remove it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from runtime.layout import CHECKPOINTS, LOCAL_RUNS, TRIAL_RUNS, TRIAL_TRAINABLE

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYOUT_MODULE = "runtime.layout"
# Folder names of the storage layout: only runtime.layout joins them into a path.
LAYOUT_FOLDERS = {CHECKPOINTS, TRIAL_RUNS, LOCAL_RUNS.name}
TRIAL_FOLDER_PREFIX = f"{TRIAL_TRAINABLE}_"


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (a folder holding __init__.py)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports (``from a import b`` counts a.b when
    that is a module, else a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            subs = {f"{module}.{a.name}" for a in node.names} & known
            found |= subs if len(subs) == len(node.names) else {module, *subs}
    return {m for m in found if m in known and m != name}


def import_graph(package: Path) -> dict[str, set[str]]:
    mods = modules(package)
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def declared_layers(markdown: str) -> dict[str, int]:
    """Package -> layer number (0 = lowest) from the ```layers block, whose lines run highest first."""
    block = re.search(r"^```layers\n(.*?)^```", markdown, re.S | re.M)
    assert block, "docs/architecture.md declares no ```layers block"
    lines = [line.split() for line in block.group(1).splitlines() if line.strip()]
    return {name: len(lines) - 1 - i for i, names in enumerate(lines) for name in names}


def unit_of(module: str) -> str:
    """The layered unit a module belongs to: its package under ``runtime``, or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Every import from one unit to another that does not run down the layers (up, or across to
    a peer), and every module whose unit has no declared layer (its importers are not checked twice)."""
    found = []
    for module, imported in sorted(graph.items()):
        unit = unit_of(module)
        if unit not in layers:
            found.append(f"{module}: {unit} has no layer in docs/architecture.md")
            continue
        for target in sorted(imported):
            other = unit_of(target)
            if other != unit and other in layers and layers[other] >= layers[unit]:
                found.append(f"{module} -> {target} ({unit} is not above {other})")
    return found


def test_runtime_imports_only_run_down_the_declared_layers() -> None:
    found = layer_violations(import_graph(ROOT / "runtime"), declared_layers(ARCHITECTURE.read_text()))
    assert not found, "imports against the layers of docs/architecture.md:\n" + "\n".join(found)


def test_layer_check_flags_upward_and_peer_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("low", "mid", "peer", "top"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from pkg.top import b\n")  # lazy, still upward
    (pkg / "mid" / "c.py").write_text("from ..low import a\nfrom pkg.peer import d\n")
    (pkg / "peer" / "d.py").write_text("")
    (pkg / "top" / "b.py").write_text("from pkg.mid import c\nimport pkg.stray\n")
    (pkg / "stray.py").write_text("")
    layers = declared_layers("x\n```layers\ntop\nmid peer\nlow pkg\n```\n")
    assert layers == {"top": 2, "mid": 1, "peer": 1, "low": 0, "pkg": 0}
    assert layer_violations(import_graph(pkg), layers) == [
        "pkg.low.a -> pkg.top.b (low is not above top)",
        "pkg.mid.c -> pkg.peer.d (mid is not above peer)",
        "pkg.stray: stray has no layer in docs/architecture.md",
    ]


def test_the_loop_never_imports_the_driver_side(tmp_path: Path) -> None:
    """The declared layers put the driver package above the loop's, so a worker-side module that
    reaches into the driver (once: the spares' watch importing the elastic callback's helper) fails."""
    layers = declared_layers(ARCHITECTURE.read_text())
    assert layers["launch"] > layers["train"]
    pkg = tmp_path / "runtime"
    for sub in ("train", "launch"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "launch" / "elastic.py").write_text("from runtime.train.capacity import refresh_capacity\n")
    (pkg / "train" / "capacity.py").write_text("")
    (pkg / "train" / "spares.py").write_text("def watch():\n    from runtime.launch.elastic import refresh_capacity\n")
    assert layer_violations(import_graph(pkg), layers) == [
        "runtime.train.spares -> runtime.launch.elastic (train is not above launch)"]


def unnamed_modules(package: Path) -> list[str]:
    """Modules of ``package`` (one level) that its docstring does not name as ````module````."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [p.stem for p in sorted(package.glob("*.py")) if p.stem != "__init__" and f"``{p.stem}``" not in doc]


def test_the_training_packages_docstrings_name_each_of_their_modules() -> None:
    """A package's docstring is its map: a module added without a line there fails here."""
    found = {pkg: unnamed_modules(ROOT / "runtime" / pkg) for pkg in ("train", "launch")}
    assert found == {"train": [], "launch": []}, f"modules missing from their package's docstring: {found}"


MAX_LINES = 400
LONG_REASON = re.compile(r"over 400 lines", re.I)


def long_without_reason(package: Path) -> list[str]:
    """Modules over MAX_LINES lines whose docstring does not say why (``Over 400 lines because ...``)."""
    found = []
    for name, path in modules(package).items():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_LINES and not LONG_REASON.search(ast.get_docstring(ast.parse(source)) or ""):
            found.append(f"{name}: {lines} lines, and its docstring gives no reason (\"Over 400 lines because ...\")")
    return found


def test_runtime_modules_over_400_lines_say_why() -> None:
    found = long_without_reason(ROOT / "runtime")
    assert not found, "split these modules or say in their docstring why they are long:\n" + "\n".join(found)


def test_test_files_over_400_lines_say_why() -> None:
    """The same rule for tests/: a test file that grows past 400 lines is split or says why."""
    found = long_without_reason(ROOT / "tests")
    assert not found, "split these test files or say in their docstring why they are long:\n" + "\n".join(found)


def test_size_check_flags_a_long_module_only_without_its_reason(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "x = 1\n" * MAX_LINES
    (pkg / "short.py").write_text('"""Short."""\n' + "x = 1\n" * (MAX_LINES - 1))
    (pkg / "long.py").write_text('"""Long."""\n' + body)
    (pkg / "said.py").write_text('"""Long.\n\nOver 400 lines because it is one table."""\n' + body)
    assert long_without_reason(pkg) == [
        'pkg.long: 401 lines, and its docstring gives no reason ("Over 400 lines because ...")']


FIT_MAX_LINES = 30


def body_lines(source: str, cls: str, method: str) -> int:
    """Lines of ``cls.method`` after its docstring (blank and comment lines inside count too)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    has_doc = ast.get_docstring(f) is not None
                    first = f.body[1] if has_doc else f.body[0]
                    assert f.end_lineno is not None
                    return f.end_lineno - first.lineno + 1
    raise AssertionError(f"no {cls}.{method}")


def test_trainer_fit_reads_at_a_glance() -> None:
    """``Trainer.fit`` is the loop a newcomer reads first: the components own the detail."""
    source = (ROOT / "runtime" / "train" / "trainer.py").read_text()
    lines = body_lines(source, "Trainer", "fit")
    assert lines <= FIT_MAX_LINES, f"Trainer.fit is {lines} lines (at most {FIT_MAX_LINES}): move detail out"


def test_fit_length_counts_the_body_after_the_docstring() -> None:
    source = 'class Trainer:\n    def fit(self):\n        """Doc."""\n        a = 1\n\n        return a\n'
    assert body_lines(source, "Trainer", "fit") == 3


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one, as a path ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(comp, graph) for comp in components]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {comp}")


def path_pieces(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of the string pieces that build a path: f-strings, operands of ``/`` and the
    arguments of ``Path(...)``/``os.path.join(...)``; f-string fields read as ``{}``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, str(text)))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            out += [(node.lineno, n.value) for n in (node.left, node.right)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("Path", "PurePath", "os.path.join"):
            out += [(node.lineno, a.value) for a in node.args if isinstance(a, ast.Constant)
                    and isinstance(a.value, str)]
    return out


def layout_paths(source: str) -> list[tuple[int, str]]:
    """Pieces of ``source`` that join a layout folder into a path, and any text naming Tune's
    trial folders."""
    tree = ast.parse(source)
    hits = [(line, text) for line, text in path_pieces(tree)
            if text in LAYOUT_FOLDERS or ("/" in text and set(text.split("/")) & LAYOUT_FOLDERS)]
    hits += [(n.lineno, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and TRIAL_FOLDER_PREFIX in n.value]
    return sorted(set(hits))


def test_runtime_import_graph_has_no_cycles() -> None:
    found = cycles(import_graph(ROOT / "runtime"))
    assert not found, "import cycles in runtime/:\n" + "\n".join(" -> ".join(c) for c in found)


def test_cycle_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    from .. import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]


def test_only_runtime_layout_builds_run_checkpoint_and_trial_folder_paths() -> None:
    found = []
    for name, path in modules(ROOT / "runtime").items():
        if name != LAYOUT_MODULE:
            found += [f"{path.relative_to(ROOT)}:{line}: {text!r}" for line, text in layout_paths(path.read_text())]
    assert not found, "paths of the storage layout built outside runtime/layout.py:\n" + "\n".join(found)


def test_layout_path_check_flags_joined_folders_not_prose() -> None:
    source = '''
from pathlib import Path
a = f"{base}/{run}/checkpoints"
b = f"{search_dir}/runs"
c = Path("runs") / name
d = "run_trial_*"
e = "see <checkpoint.storage>/<run name>/checkpoints) for the layout"
f = f"{run} has no checkpoints"
g = "checkpoints"
'''
    assert [line for line, _ in layout_paths(source)] == [3, 4, 5, 6]


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, module.name) of every underscore name ``source`` imports from a runtime module."""
    return [(node.lineno, f"{node.module}.{a.name}") for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "runtime")
            for a in node.names if a.name.startswith("_")]


def test_no_runtime_module_imports_another_modules_private_names() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in modules(ROOT / "runtime").values()
             for line, name in private_imports(path.read_text())]
    assert not found, "private names imported across modules (make them public or move them):\n" + "\n".join(found)


def test_private_import_check_sees_absolute_and_relative_imports() -> None:
    source = "from runtime.launch.driver import _storage, connect\nfrom .x import _y\nfrom os import _exit\n"
    assert private_imports(source) == [(1, "runtime.launch.driver._storage"), (2, "x._y")]
