"""The house in rooms: herring_jax/_src is one subpackage per concern, imports
run one way between them, and no source file grows past a sitting's reading.

The floors, bottom first, and what each may import (besides itself):

  process      nothing of herring_jax
  launcher     process                 (and never jax: `herring-jax launch` starts fast)
  collectives  process
  transforms   process, collectives
  checkpoints  process, collectives, transforms
  tools        everything above
  cli.py       everything              (the `herring-jax` command dispatches to all)
"""
import ast
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SRC = os.path.join(_ROOT, "herring_jax", "_src")

_MAY_IMPORT = {
    "process": set(),
    "launcher": {"process"},
    "collectives": {"process"},
    "transforms": {"process", "collectives"},
    "checkpoints": {"process", "collectives", "transforms"},
    "tools": {"process", "launcher", "collectives", "transforms", "checkpoints"},
    "cli": {"process", "launcher", "collectives", "transforms", "checkpoints", "tools"},
}
_LIBRARY = ("process", "launcher", "collectives", "transforms", "checkpoints")
_MAX_LINES = 600


def _sources():
    """(floor, dotted module name, path) of every module under _src."""
    found = []
    for root, _, files in os.walk(_SRC):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, _SRC)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if not rel:
                continue  # _src/__init__.py
            found.append((rel[0], "herring_jax._src." + ".".join(rel), path))
    return found


def _imports(path, top_level_only=False):
    """The herring_jax._src modules a file imports: at module level only, or
    anywhere (in functions too)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            # `from herring_jax._src.process import knobs` imports the module
            # herring_jax._src.process.knobs.
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n.startswith("herring_jax._src.")]


def test_src_holds_only_the_floors_and_each_says_what_it_holds():
    entries = {e for e in os.listdir(_SRC) if e not in ("__pycache__", "__init__.py")}
    assert entries == {*_LIBRARY, "tools", "cli.py"}, (
        f"herring_jax/_src holds {sorted(entries)}: a new module goes into the subpackage of its "
        "concern (see herring_jax/_src/__init__.py), a new concern into tests/test_layout.py")
    for floor in (*_LIBRARY, "tools"):
        with open(os.path.join(_SRC, floor, "__init__.py")) as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        assert doc and len(doc) > 40, f"{floor}/__init__.py says nothing of what it holds"


def test_imports_run_one_way_between_the_floors():
    # Imports inside functions count: a lazy import across a floor is a
    # circle all the same, only a later one.
    wrong = []
    for floor, module, path in _sources():
        for name in _imports(path):
            target = name.split(".")[2]
            if target != floor and target not in _MAY_IMPORT[floor]:
                wrong.append(f"{module} imports {name}")
    assert sorted(set(wrong)) == [], "\n".join(sorted(set(wrong)))


def test_no_import_circle_between_modules():
    modules = {m: p for _, m, p in _sources()}
    # A package is imported before its modules, so a module's import of its
    # own package (`from herring_jax._src.tools.bench import collectives`)
    # closes no circle.
    graph = {m: {n for n in _imports(p, top_level_only=True)
                 if n in modules and n != m and not m.startswith(n + ".")}
             for m, p in modules.items()}
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_library_loads_without_the_tools_and_the_launcher_without_jax(tmp_path):
    # What the static checks above say, seen by the interpreter: every library
    # module imports with the tools made unimportable, and the launcher's with
    # jax made unimportable too.
    library = sorted(m for floor, m, _ in _sources() if floor in _LIBRARY)
    launcher = sorted(m for floor, m, _ in _sources() if floor == "launcher")
    assert len(library) > 40 and "herring_jax._src.process.runtime" in library, library
    code = (
        "import importlib, importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    blocked = ('herring_jax._src.tools',)\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if any(name == b or name.startswith(b + '.') for b in self.blocked):\n"
        "            raise ImportError('imported ' + name)\n"
        "block = Block()\n"
        "sys.meta_path.insert(0, block)\n"
        "if sys.argv[1] == 'launcher':\n"
        "    block.blocked += ('jax', 'jaxlib', 'numpy')\n"
        "import herring_jax, herring_jax.launch\n"
        "for m in sys.argv[2:]:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.startswith('herring_jax._src.tools')))\n")
    for which, modules in (("launcher", launcher), ("library", library)):
        proc = subprocess.run([sys.executable, "-P", "-c", code, which, *modules], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, which + ": " + proc.stderr[-3000:]
        assert proc.stdout.strip() == "[]", proc.stdout


def test_no_source_file_is_past_600_lines():
    long = []
    for top in ("herring_jax", "xla_ffi", "tests"):
        for root, dirs, files in os.walk(os.path.join(_ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith((".py", ".cc", ".h", ".cu", ".sh")):
                    path = os.path.join(root, name)
                    with open(path, errors="replace") as f:
                        n = sum(1 for _ in f)
                    if n > _MAX_LINES:
                        long.append(f"{os.path.relpath(path, _ROOT)}: {n} lines")
    assert long == [], ("split these by concern (docs/development.md says how):\n"
                        + "\n".join(long))
