"""What the pages say that the code can check cheaply (no processes, no build):
every example flag a page names exists in that example's argparse, every
HERRING_* variable the code reads or sets is declared in knobs.py (hence on
the knobs page), every public name is in semantics.md's API list, every
counter of herring_jax.stats() is defined on the timeline page, and the README
and Getting started name everything `.ci/install.sh demo` installs."""

import ast
import functools
import pathlib
import re

import herring_jax
from herring_jax._src.process import knobs

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PAGES = sorted([*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "guides").glob("*.md"),
                ROOT / "README.md"])

# A script whose arguments go to an example (run_demo.sh: "Arguments go to
# examples/demo_train.py").
PASSES_ARGUMENTS_TO = {"run_demo.sh": "demo_train.py"}

# HERRING_* names in the code that are no environment variables, so knobs.py
# does not declare them. Include guards (HERRING_..._H_) are left out by their
# form.
NOT_ENVIRONMENT = {
    "HERRING_ATTRS": "C++ macro (handler_common.h): a handler's attributes",
    "HERRING_ATTR_PARAMS": "C++ macro (handler_common.h): a handler's attribute parameters",
    "HERRING_TSAN": "C++ macro (handler_common.h): built under ThreadSanitizer",
    "HERRING_WITH_CUDA": "C++ macro (CMakeLists.txt): the XLA:CUDA handlers are built",
    "HERRING_CUDA": "CMake option (-DHERRING_CUDA=OFF): build the CUDA handlers",
    "HERRING_SANITIZE": "CMake option (-DHERRING_SANITIZE=thread ...): .ci/sanitizers.sh",
    "HERRING_RESULT": "output line prefix (servers.py, tests/workers): a JSON result to parse",
}


def _flags_in(module: str, node: ast.AST, seen: set) -> set[str]:
    """The option strings of every add_argument call under `node`, following
    calls into functions of `module` and of the other examples."""
    flags: set[str] = set()
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "add_argument":
            flags |= {a.value for a in call.args
                      if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
        elif isinstance(func, ast.Name):
            flags |= _function_flags(module, func.id, seen)
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
              and (EXAMPLES / f"{func.value.id}.py").exists()):
            flags |= _function_flags(func.value.id, func.attr, seen)
    return flags


def _function_flags(module: str, name: str, seen: set) -> set[str]:
    if (module, name) in seen:
        return set()
    seen.add((module, name))
    for node in _parse(f"{module}.py").body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _flags_in(module, node, seen)
    return set()


@functools.cache
def _parse(script: str) -> ast.Module:
    return ast.parse((EXAMPLES / script).read_text())


@functools.cache
def example_flags(script: str) -> frozenset[str]:
    script = PASSES_ARGUMENTS_TO.get(script, script)
    return frozenset(_flags_in(script.removesuffix(".py"), _parse(script), set()))


_EXAMPLE = re.compile(r"examples/(\w+\.(?:py|sh))")
_COMMAND_END = {"|", "||", "&&", ";", ">", "2>&1", "&"}


def _flags_after(text: str) -> set[str]:
    flags = set()
    for token in text.split():
        if token.startswith("#") or token in _COMMAND_END:
            break
        if token.startswith("--") and token != "--":
            flags.add(token.split("=")[0].rstrip(".,;:)"))
    return flags


def named_example_flags(text: str) -> list[tuple[str, str]]:
    """(script, flag) for every `examples/X.py --flag ...` of a Markdown page:
    in its code blocks (to the end of the command) and in its inline code."""
    named = []
    prose, fenced = [], False
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            prose.append(line)
            continue
        for m in _EXAMPLE.finditer(line):
            named += [(m.group(1), f) for f in _flags_after(line[m.end():])]
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        for m in _EXAMPLE.finditer(span):
            named += [(m.group(1), f) for f in _flags_after(span[m.end():])]
    return named


def test_every_example_flag_a_page_names_exists():
    named = {(page.relative_to(ROOT).as_posix(), script, flag)
             for page in PAGES for script, flag in named_example_flags(page.read_text())}
    assert named, "no page names an example's flag: the search below is broken"
    missing = sorted(f"{page}: examples/{script} {flag}" for page, script, flag in named
                     if (EXAMPLES / script).exists() and flag not in example_flags(script))
    assert not missing, ("pages name flags their examples do not take (fix the page, or the "
                         f"example's argparse): {missing}")
    absent = sorted(f"{page}: examples/{script}" for page, script, _ in named
                    if not (EXAMPLES / script).exists())
    assert not absent, f"pages name examples that do not exist: {absent}"


def test_the_flag_reader_sees_what_argparse_sees():
    # The reader above follows train_lm.py into data_parallel.add_arguments and
    # from there into add_local_sgd_arguments; --reduce is data_parallel's,
    # train_nnx.py has none.
    assert {"--reduce", "--local-steps", "--text-bytes", "--checkpoint-dir"} <= \
        example_flags("train_lm.py")
    assert "--reduce" not in example_flags("train_nnx.py")
    assert "--plot" in example_flags("run_demo.sh")
    page = ("`examples/train_lm.py --fully-sharded --checkpoint-dir DIR\n--checkpoint-every k`"
            "\n```bash\nherring-jax launch -n 2 -- python examples/train_nnx.py --sharded "
            "--steps=3  # not --lr\n```\n")
    assert sorted(named_example_flags(page)) == sorted([
        ("train_lm.py", "--fully-sharded"), ("train_lm.py", "--checkpoint-dir"),
        ("train_lm.py", "--checkpoint-every"), ("train_nnx.py", "--sharded"),
        ("train_nnx.py", "--steps")])


def code_variables() -> dict[str, str]:
    """Every HERRING_* name in the library, the extension and the examples,
    with one file that holds it."""
    names = {}
    for folder in ("herring_jax", "xla_ffi", "examples"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or not (
                    path.suffix in (".py", ".cc", ".h", ".cu", ".sh", ".cmake")
                    or path.name == "CMakeLists.txt"):
                continue
            for name in re.findall(r"\bHERRING_[A-Z0-9_]*[A-Z0-9]\b|\bHERRING_\w+_H_\b",
                                   path.read_text(errors="replace")):
                names.setdefault(name, path.relative_to(ROOT).as_posix())
    return names


def test_every_herring_variable_in_the_code_is_declared_in_knobs():
    names = code_variables()
    undeclared = sorted(f"{name} ({where})" for name, where in names.items()
                        if name not in knobs.KNOBS and name not in NOT_ENVIRONMENT
                        and not name.endswith("_H_"))
    assert not undeclared, (
        f"HERRING_* names used in the code but not declared in herring_jax/_src/process/knobs.py: "
        f"{undeclared}. Declare each environment variable there (then paste knobs."
        "markdown_table() over docs/guides/knobs.md's table); add a name that is no "
        "environment variable to NOT_ENVIRONMENT here, saying what it is")
    stale = sorted(set(NOT_ENVIRONMENT) - set(names))
    assert not stale, f"NOT_ENVIRONMENT names what the code no longer holds: {stale}"
    both = sorted(set(NOT_ENVIRONMENT) & set(knobs.KNOBS))
    assert not both, f"declared as knobs and listed as no environment variable: {both}"


def semantics_api_list() -> set[str]:
    page = (ROOT / "docs" / "guides" / "semantics.md").read_text()
    m = re.search(r"^API\b(.*?)\n\n", page, re.MULTILINE | re.DOTALL)
    assert m, "docs/guides/semantics.md has no paragraph beginning 'API'"
    return set(re.findall(r"`([A-Za-z_]\w*)", m.group(1)))


def test_every_public_name_is_in_the_api_list_of_semantics():
    missing = sorted(set(herring_jax.__all__) - semantics_api_list())
    assert not missing, (f"docs/guides/semantics.md's API list (the paragraph beginning "
                         f"'API') lacks {missing}")


def stats_keys() -> set[str]:
    """The keys herring_jax.stats() returns (xla_ffi/bindings.cc fills the dict)."""
    source = (ROOT / "xla_ffi" / "bindings.cc").read_text()
    body = source[source.index('m.def("stats"'):]
    body = body[:body.index("return d;")]
    return set(re.findall(r'd\["(\w+)"\]', body))


def test_every_counter_of_stats_is_defined_on_the_timeline_page():
    keys = stats_keys()
    assert {"bytes_reduced", "bytes_sent", "reductions"} <= keys, keys
    page = (ROOT / "docs" / "guides" / "timeline.md").read_text()
    table = page[page.index("## Counters"):]
    undefined = sorted(k for k in keys if f"| `{k}` |" not in table)
    assert not undefined, (f"docs/guides/timeline.md's table of counters lacks {undefined} "
                           "(herring_jax.stats(), xla_ffi/bindings.cc)")


def demo_installs() -> set[str]:
    """What `bash .ci/install.sh demo` installs: the apt packages added before
    the tests' level, and the pip packages of its first deps list."""
    script = (ROOT / ".ci" / "install.sh").read_text()
    demo = script[:script.index("if ((level >= 2))")]
    apt = set(re.findall(r"apt_pkgs\+=\(([\w.+-]+)\)", demo))
    deps = re.search(r"^deps=\((.*?)\)$", script, re.MULTILINE | re.DOTALL).group(1)
    pip = {re.match(r"[A-Za-z0-9_.-]+", d.strip('"')).group(0) for d in deps.split()}
    return apt | pip


def test_the_pages_that_say_what_the_demo_installs_agree_with_install_sh():
    names = demo_installs()
    assert {"libfabric-dev", "jax", "flax", "matplotlib"} <= names, names
    for page in (ROOT / "README.md", ROOT / "docs" / "getting_started.md"):
        paragraphs = [p for p in page.read_text().split("\n\n") if ".ci/install.sh demo`" in p]
        assert paragraphs, f"{page.name} no longer says what `.ci/install.sh demo` installs"
        words = set(re.findall(r"[\w.+-]+", paragraphs[0]))
        missing = sorted(names - words)
        assert not missing, (f"{page.name}'s paragraph on `.ci/install.sh demo` does not name "
                             f"{missing}, which it installs")
