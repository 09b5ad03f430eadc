"""Dependencies point one way: entry points and servers -> algorithms -> training -> (rl, generation,
models, data, clients) -> runtime. The library never imports the servers; every package and top-level
module of the library sits on a floor and imports only floors below it; no import circles; the library's
own imports sit at the top of each file.

Read from the source (an AST walk), so imports inside functions count too.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "aligner"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module name) of every import statement in a file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend([(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{alias.name}")
                                                         for alias in node.names])
    return found


def servers_imports(directory: Path) -> list[str]:
    """"file:line: module" of every import of the servers package under `directory`."""
    return [f"{path.relative_to(directory)}:{line}: {module}"
            for path in sorted(directory.rglob("*.py"))
            for line, module in imported_modules(path)
            if module == "servers" or module.startswith("servers.")]


def test_the_library_imports_nothing_from_servers():
    assert LIBRARY.is_dir()
    assert servers_imports(LIBRARY) == []


# package of aligner -> aligner packages it must not import
UPWARD = {
    "generation": {"algorithms", "training"},
    "rl": {"algorithms", "training"},
    "data": {"algorithms", "training"},
    "hf": {"algorithms", "training"},
    "models": {"algorithms", "training", "generation", "rl"},
    "runtime": "everything",  # the bottom layer imports no other part of the library
    "clients": "everything",  # the clients stand alone: users import them without the training stack
}


def aligner_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "aligner" and len(parts) > 1 else ""


def test_lower_layers_do_not_import_upper_ones():
    wrong = []
    for package, forbidden in UPWARD.items():
        for path in sorted((LIBRARY / package).rglob("*.py")):
            for line, module in imported_modules(path):
                target = aligner_package(module)
                if target and target != package and (forbidden == "everything" or target in forbidden):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert wrong == []


def test_the_check_sees_imports_at_any_depth(tmp_path):
    package = tmp_path / "package"
    package.mkdir()
    (package / "top.py").write_text("import servers\n")
    (package / "nested.py").write_text("def f():\n    from servers.router import WorkQueue\n")
    (package / "aliased.py").write_text("import servers.critic as critic\n")
    (package / "clean.py").write_text("from aligner import servers_like\nimport serverside\n")
    assert servers_imports(package) == ["aliased.py:1: servers.critic", "nested.py:2: servers.router",
                                        "nested.py:2: servers.router.WorkQueue", "top.py:1: servers"]


# ----------------------------------------------------------------------------- floors of the whole library
# Every package and top-level module of aligner (a "room") on its floor, bottom first. A room imports only
# rooms on lower floors (and itself): rooms on one floor do not import each other.
FLOORS = {
    "runtime": 0, "clients": 0,  # the clients stand alone: users import them without the training stack
    "__init__": 1, "config": 1,
    "checkpointing": 2, "tokenizer": 2,
    "models": 3, "rl": 3,  # models: the networks and the logprob kernel; rl: pure tensor math
    "data": 4, "hf": 4,
    "generation": 5,  # engines, rollouts, reward sources
    "agents": 6,  # episodes, the chat renderer across turns, environments, tools, the sandbox
    "training": 7,
    "algorithms": 8, "demo": 8, "launcher": 8,
    "__main__": 9,  # python -m aligner: the training entry points, above everything like examples/ (a wheel has none)
}

# Imports of aligner's own modules that stay inside functions, by file: the modules each imports there.
# aligner.models.layers subclasses megatron-core's layers, so importing it imports megatron-core, which nothing
# else in the library does at import time: the functions that build a model import it, and an entry point
# prints --help or a config error without loading megatron-core. (Said once, in aligner/models/layers.py;
# each of these imports carries a short comment pointing there.) Optional extras (TensorRT-LLM, PyTriton,
# W&B, GGUF, peft, matplotlib) are third-party imports and do not count here.
FUNCTION_LEVEL_IMPORTS = {
    "aligner/models/gpt.py": {"aligner.models.layers"},
}


def library_modules(library: Path) -> dict[str, Path]:
    """Dotted module name -> file, of every module under `library` (a package directory named aligner)."""
    modules = {}
    for path in sorted(library.rglob("*.py")):
        parts = list(path.relative_to(library.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def own_imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[int, str, bool]]:
    """(line, imported library module, inside a function) of every import of a library module in a file,
    at any depth. `from package import module` is an import of that module; relative imports resolve."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    root = name.split(".")[0]

    def resolve(dotted: str) -> str:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package
                    for _ in range(child.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in child.names]
            for dotted in names:
                target = resolve(dotted) if dotted == root or dotted.startswith(root + ".") else ""
                if target and target != name:
                    found.append((child.lineno, target, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(library: Path) -> list[str]:
    """"file:line: module" of every import of a room on the same or a higher floor than the importer's."""
    modules = library_modules(library)
    wrong = []
    for name, path in modules.items():
        for line, target in sorted({(line, target) for line, target, _ in own_imports(path, name, modules)}):
            here, there = room(name), room(target)
            if here != there and FLOORS[there] >= FLOORS[here]:
                wrong.append(f"{path.relative_to(library.parent)}:{line}: {target}")
    return wrong


def import_circles(library: Path) -> list[list[str]]:
    """The module-level import graph's circles (strongly connected components of more than one module)."""
    modules = library_modules(library)
    graph = {name: sorted({target for _, target, _ in own_imports(path, name, modules)})
             for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def connect(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            connect(module)
    return sorted(circles)


def function_level_imports(library: Path) -> dict[str, set[str]]:
    """file -> the library modules it imports inside a function."""
    modules = library_modules(library)
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        for _, target, in_function in own_imports(path, name, modules):
            if in_function:
                found.setdefault(str(path.relative_to(library.parent)), set()).add(target)
    return found


def test_every_room_of_the_library_has_a_floor():
    rooms = {room(name) for name in library_modules(LIBRARY)}
    assert rooms - FLOORS.keys() == set(), "give the new package or module a floor in FLOORS"
    assert FLOORS.keys() - rooms == set()


def test_no_import_runs_back_up_a_floor():
    assert upward_imports(LIBRARY) == []


def test_no_import_circle_between_library_modules():
    assert import_circles(LIBRARY) == []


def test_imports_of_the_library_sit_at_the_top_of_each_file():
    assert function_level_imports(LIBRARY) == FUNCTION_LEVEL_IMPORTS


def _library_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "aligner"
    shutil.copytree(LIBRARY, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_floor_check_sees_an_upward_import_at_any_depth(tmp_path):
    copy = _library_copy(tmp_path)
    assert upward_imports(copy) == []
    seeds = copy / "runtime" / "seeds.py"
    seeds.write_text(seeds.read_text() + "\n\ndef _later():\n    from aligner.training import trainer\n")
    lines = len(seeds.read_text().splitlines())
    tokenizer = copy / "tokenizer.py"
    tokenizer.write_text("from aligner import checkpointing\n" + tokenizer.read_text())  # same floor
    assert upward_imports(copy) == ["aligner/runtime/seeds.py:" f"{lines}: aligner.training.trainer",
                                    "aligner/tokenizer.py:1: aligner.checkpointing"]


def test_the_circle_and_function_level_checks_see_a_nested_import(tmp_path):
    copy = _library_copy(tmp_path)
    masked = copy / "rl" / "masked.py"
    masked.write_text(masked.read_text() + "\n\ndef _later():\n    from aligner.rl import policy_losses\n")
    assert import_circles(copy) == [["aligner.rl.masked", "aligner.rl.policy_losses"]]
    assert function_level_imports(copy) == {**FUNCTION_LEVEL_IMPORTS,
                                            "aligner/rl/masked.py": {"aligner.rl.policy_losses"}}


# ----------------------------------------------------------------------------- module size
MAX_MODULE_LINES = 800  # past this a module holds more than one concern: split it along its seam


def long_modules(library: Path) -> dict[str, int]:
    """file -> line count of every module under `library` longer than MAX_MODULE_LINES."""
    counts = {str(path.relative_to(library.parent)): len(path.read_text().splitlines())
              for path in sorted(library.rglob("*.py"))}
    return {name: count for name, count in counts.items() if count > MAX_MODULE_LINES}


def test_no_module_of_the_library_is_over_800_lines():
    assert long_modules(LIBRARY) == {}


def test_the_size_check_counts_every_module_at_any_depth(tmp_path):
    library = tmp_path / "aligner"
    (library / "package").mkdir(parents=True)
    (library / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (library / "package" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(library) == {"aligner/package/long.py": MAX_MODULE_LINES + 1}
