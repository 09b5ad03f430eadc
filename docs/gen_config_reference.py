"""The configuration reference, generated at build time (a mkdocs hook named in mkdocs.yml).

Each entry point in examples/nlp/gpt/ names its schema and its yaml in one call (`run_training(Schema,
"name.yaml", ...)` or `parse_command_line(CONF_DIR / "name.yaml", schema=Schema)`); `entry_points()` reads
that call, and the page of each lists every key of the schema with its type, its default (the yaml's value),
its allowed values and its comment (the yaml's line, else the schema field's): `aligner.config.key_rows`, the
rows `--help` prints. A renamed or retired key changes the reference with the code. The docs' command check
(tests/unit/test_docs.py) uses the same `entry_points()`.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
ENTRY_DIR = REPO_ROOT / "examples" / "nlp" / "gpt"
REFERENCE_DIR = "reference/config"  # the generated pages, under docs/

_CALLS = (re.compile(r"run_training\(\s*(?P<schema>\w+),\s*\"(?P<yaml>[\w./]+)\""),
          re.compile(r"parse_command_line\(\s*CONF_DIR\s*/\s*\"(?P<yaml>[\w./]+)\",\s*schema=(?P<schema>\w+)\)"))


class EntryPoint(NamedTuple):
    script: str  # examples/nlp/gpt/NAME.py
    schema: type
    yaml_path: Path

    @property
    def page(self) -> str:
        """The reference page, relative to docs/."""
        return f"{REFERENCE_DIR}/{Path(self.script).stem}.md"


def _load_script(path: Path):
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    spec = importlib.util.spec_from_file_location(f"_entry_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts run only under __main__
    return module


def entry_points() -> dict[str, EntryPoint]:
    """{script path relative to the repo: its schema and default yaml} of each entry point with one schema."""
    from aligner.config import CONF_DIR

    found = {}
    for path in sorted(ENTRY_DIR.glob("*.py")):
        text = path.read_text()
        match = next((m for pattern in _CALLS for m in [pattern.search(text)] if m), None)
        if match is None:
            continue
        schema = getattr(_load_script(path), match.group("schema"))
        script = str(path.relative_to(REPO_ROOT))
        found[script] = EntryPoint(script, schema, CONF_DIR / match.group("yaml"))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code_cell(text: str) -> str:
    """A table cell in backticks: Python-Markdown's tables do not split a code span at its pipes."""
    return f"`{text.replace('`', '')}`".replace("\n", " ")


def reference_page(entry: EntryPoint) -> str:
    from aligner.config import key_rows

    yaml_name = entry.yaml_path.relative_to(REPO_ROOT)
    lines = [f"# `{Path(entry.script).name}`", "",
             f"Schema `{entry.schema.__module__}.{entry.schema.__qualname__}`, defaults from `{yaml_name}` "
             f"(the schema's where the yaml does not set a key). Generated from the code at build time; "
             f"`python {entry.script} --help` prints the same keys.", "",
             "| Key | Type | Default | Allowed | Comment |", "|---|---|---|---|---|"]
    for row in key_rows(entry.schema, entry.yaml_path):
        lines.append(f"| `{row.key}` | {_code_cell(row.type)} | {_code_cell(row.default)} | {_cell(row.allowed)} | "
                     f"{_cell(row.comment)} |")
    return "\n".join(lines) + "\n"


def index_page(entries: dict[str, EntryPoint]) -> str:
    lines = ["# Configuration reference", "",
             "Every key of every entry point, generated from its schema and yaml when the site is built. "
             "Override any key on the command line as `key=value` (dotted for nested keys); see "
             "[Config and overrides](../../concepts/config.md).", "",
             "| Entry point | Schema | Default yaml |", "|---|---|---|"]
    for entry in entries.values():
        lines.append(f"| [`{Path(entry.script).name}`]({Path(entry.page).name}) | `{entry.schema.__name__}` | "
                     f"`{entry.yaml_path.relative_to(REPO_ROOT)}` |")
    return "\n".join(lines) + "\n"


def key_changes_table(entries: dict[str, EntryPoint]) -> str:
    """The renamed and retired keys each entry point's schema still accepts (`RENAMED_KEYS`, `RETIRED_KEYS`:
    `aligner.config.load_config` moves or drops them with a 'deprecated' line)."""
    lines = ["| Entry point | Old key | Now |", "|---|---|---|"]
    for entry in entries.values():
        name = f"`{Path(entry.script).name}`"
        for old, new in getattr(entry.schema, "RENAMED_KEYS", ()):
            lines.append(f"| {name} | `{old}` | renamed to `{new}` |")
        for old, instead in getattr(entry.schema, "RETIRED_KEYS", ()):
            lines.append(f"| {name} | `{old}` | retired: {_cell(instead)} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown, page, config, files):
    """mkdocs hook: `{{ key_changes }}` in a page becomes the table of renamed and retired keys."""
    if "{{ key_changes }}" in markdown:
        markdown = markdown.replace("{{ key_changes }}", key_changes_table(entry_points()))
    return markdown


def on_files(files, config):
    """mkdocs hook: add the generated reference pages to the site's files."""
    from mkdocs.structure.files import File

    entries = entry_points()
    files.append(File.generated(config, f"{REFERENCE_DIR}/index.md", content=index_page(entries)))
    for entry in entries.values():
        files.append(File.generated(config, entry.page, content=reference_page(entry)))
    return files
