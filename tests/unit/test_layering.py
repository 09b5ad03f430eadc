"""Dependencies point one way: entry points and servers -> algorithms -> training -> (rl, generation,
models, data, clients) -> runtime. The library never imports the servers.

Read from the source (an AST walk), so imports inside functions count too.
"""
from __future__ import annotations

import ast
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
