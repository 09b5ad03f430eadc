"""The docs cannot drift from the code: the site builds with warnings as errors (a broken internal link
fails), and every command the README and the docs pages show runs an entry point that exists with
`key=value` overrides its schema accepts (the project's own `load_config`, whose unknown-key error names the
key in one line)."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from aligner.config import CONF_DIR, ConfigError, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
gen_config_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_config_reference)

ENTRY_SCRIPT = re.compile(r"(?:^|\s)(?:python\s+|torchrun\s.*?)?(examples/nlp/gpt/\w+\.py)")


def _mkdocs(config_file: Path, site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
                           "--site-dir", str(site_dir)], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "NO_MKDOCS_2_WARNING": "1"})


def test_the_docs_site_builds_strict_with_the_generated_reference(tmp_path):
    result = _mkdocs(REPO_ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    for entry in gen_config_reference.entry_points().values():
        page = tmp_path / "site" / entry.page.replace(".md", "") / "index.html"
        assert page.is_file(), page
    dpo = (tmp_path / "site" / "reference" / "config" / "train_gpt_dpo" / "index.html").read_text()
    assert "dpo.preference_loss" in dpo and "one of dpo | ipo" in dpo  # a key with its allowed values
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert "reward_model_file" in changelog and "combine_rm_and_critic" in changelog


def test_a_broken_internal_link_fails_the_build(tmp_path):
    """The project's mkdocs.yml settings (strict, link validation) over one page with a link to nothing."""
    settings = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())
    for key in ("hooks", "nav", "exclude_docs"):
        settings.pop(key, None)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the guide](guides/missing.md).\n")
    settings["docs_dir"] = str(tmp_path / "docs")
    config_file = tmp_path / "mkdocs.yml"
    config_file.write_text(yaml.safe_dump(settings))
    result = _mkdocs(config_file, tmp_path / "site")
    assert result.returncode != 0
    assert "guides/missing.md" in result.stdout + result.stderr


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md"])
def test_the_readmes_links_point_at_files_and_headings_that_exist(page):
    """The READMEs are outside the docs site (mkdocs does not check them): every relative link names a file
    of the repository, and a #fragment a heading of that page."""
    source = REPO_ROOT / page
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.exists(), f"{page}: link to {target}: no such file"
        if fragment:
            headings = re.findall(r"(?m)^#+ (.*)$", linked.read_text())
            anchors = {_github_anchor(heading) for heading in headings}
            assert fragment in anchors, f"{page}: link to {target}: no such heading"


def test_the_readmes_algorithm_table_names_every_entry_point_and_existing_configs():
    """One row per algorithm: every training/serving script of examples/nlp/gpt/ is named, and every script
    and yaml the table names exists."""
    readme = (REPO_ROOT / "README.md").read_text()
    table = readme[readme.index("## Algorithms"):].split("\n\n## ")[0]
    named = set(re.findall(r"`(\w+\.(?:py|yaml))`", table))
    scripts = {path.name for path in (REPO_ROOT / "examples" / "nlp" / "gpt").glob("*.py")}
    assert scripts <= named, f"README's algorithm table lacks {sorted(scripts - named)}"
    for name in named:
        where = REPO_ROOT / "examples" / "nlp" / "gpt" / name if name.endswith(".py") else CONF_DIR / name
        assert where.is_file(), f"README's algorithm table names {name}: no such file"


def _code_lines(text: str):
    """(line number, line) of each line inside a fenced code block or an indented (4-space) code block."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            yield number, line


def documented_commands():
    """(page:line, command tokens) of every shell command in the README and docs pages that runs an entry
    point of examples/nlp/gpt/ or `python -m aligner.hf`; backslash continuations joined, comments dropped."""
    commands = []
    for page in PAGES:
        pending, start = "", 0
        for number, line in _code_lines(page.read_text()):
            if not pending:
                start = number
            pending += line.strip().removesuffix("\\") + " "
            if line.rstrip().endswith("\\"):
                continue
            command, pending = pending.split(" #")[0].strip(), ""
            if ENTRY_SCRIPT.search(command) or "python -m aligner.hf " in command:
                where = f"{page.relative_to(REPO_ROOT)}:{start}"
                commands.append(pytest.param(shlex.split(command), id=where))
    return commands


def _overrides(tokens: list[str]) -> tuple[list[str], bool]:
    """The key=value tokens and whether the command elides some (`...`, `[optional ...]`)."""
    elided = any(token.strip("[]") == "..." for token in tokens)
    return [token for token in tokens if "=" in token and not token.startswith(("-", "$"))
            and re.match(r"[\w.\[\]]+=", token)], elided


def _load(schema, yaml_path, overrides, elided):
    """The project's config loading; a command that elides its other settings may leave a required one
    unset (the keys it does show were all accepted before that check)."""
    try:
        load_config(schema, yaml_path, overrides)
    except ConfigError as error:
        if not (elided and "missing mandatory value" in str(error)):
            raise


def _flag_values(tokens: list[str], flag: str) -> list[str]:
    return [tokens[index + 1].strip("[]") for index, token in enumerate(tokens[:-1]) if token.strip("[") == flag]


@pytest.mark.parametrize("tokens", documented_commands())
def test_every_documented_command_names_a_script_and_keys_that_exist(tokens):
    if "-m" in tokens and "aligner.hf" in tokens:
        from aligner.hf.__main__ import parse_args

        parse_args([token.strip("[]") for token in tokens[tokens.index("aligner.hf") + 1:]])  # [optional flags]
        return
    script = next(token for token in tokens if ENTRY_SCRIPT.search(" " + token))
    assert (REPO_ROOT / script).is_file(), f"{script} does not exist"
    entries = gen_config_reference.entry_points()
    if script.endswith("launch_ppo.py"):  # KEY=VALUE after --actor-arg / --critic-arg, each to its schema
        from aligner.algorithms.rl_config import RLActorConfig
        from servers.critic import CriticServerConfig

        elided = True  # the launcher sets the rest (the critic's init_from, ports, directories)
        _load(RLActorConfig, CONF_DIR / "gpt_ppo_actor.yaml", _flag_values(tokens, "--actor-arg"), elided)
        _load(CriticServerConfig, CONF_DIR / "gpt_ppo_critic.yaml", _flag_values(tokens, "--critic-arg"), elided)
        return
    rest = tokens[tokens.index(script) + 1:]
    if script not in entries:  # an argparse entry point (no yaml): every flag the command gives is one it has
        usage = subprocess.run([sys.executable, str(REPO_ROOT / script), "--help"], capture_output=True, text=True,
                               cwd=REPO_ROOT, timeout=120)
        flags = [token.strip("[]") for token in rest if token.strip("[").startswith("--")]
        assert usage.returncode == 0 and flags, usage.stderr[-2000:]
        assert all(re.search(rf"(^|\s){re.escape(flag)}\b", usage.stdout) for flag in flags), (flags, usage.stdout)
        return
    entry = entries[script]
    configs = _flag_values(rest, "--config")
    yaml_path = REPO_ROOT / configs[0] if configs else entry.yaml_path
    assert yaml_path.is_file(), f"--config {yaml_path} does not exist"
    overrides, elided = _overrides(rest)
    _load(entry.schema, yaml_path, overrides, elided)
