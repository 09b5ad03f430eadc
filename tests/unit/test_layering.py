"""Dependencies point one way: servers import the library, the library never imports the servers.

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


def test_the_check_sees_imports_at_any_depth(tmp_path):
    package = tmp_path / "package"
    package.mkdir()
    (package / "top.py").write_text("import servers\n")
    (package / "nested.py").write_text("def f():\n    from servers.router import WorkQueue\n")
    (package / "aliased.py").write_text("import servers.critic as critic\n")
    (package / "clean.py").write_text("from aligner import servers_like\nimport serverside\n")
    assert servers_imports(package) == ["aliased.py:1: servers.critic", "nested.py:2: servers.router",
                                        "nested.py:2: servers.router.WorkQueue", "top.py:1: servers"]
