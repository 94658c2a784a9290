"""docs/operations.md names every flag and variable the services take, and nothing they do not."""

from __future__ import annotations

import pathlib
import re

import pytest

from shardtrain import settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
SETTINGS = (ROOT / "shardtrain" / "settings.py").read_text()


def table_after(heading: str) -> str:
    """The markdown table that follows `heading`."""
    rest = OPERATIONS.split(heading, 1)[1]
    rows = []
    for line in rest.splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return "\n".join(rows)


PARSERS = {"### Coordinator flags": settings.coordinator_parser, "### Shard flags": settings.shard_parser}


def options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--")}


@pytest.mark.parametrize("heading", list(PARSERS))
def test_every_flag_a_table_names_is_one_the_service_takes(heading):
    table, taken = table_after(heading), options(PARSERS[heading]({}))
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)`", table))
    assert named and named <= taken, f"{heading} names flags the parser lacks: {sorted(named - taken)}"


@pytest.mark.parametrize("heading", list(PARSERS))
def test_every_flag_the_service_takes_is_documented(heading):
    taken = options(PARSERS[heading]({})) - {"--help"}
    undocumented = {flag for flag in taken if not re.search(rf"`{flag}[` ]", OPERATIONS)}
    assert not undocumented, f"{heading.removeprefix('### ')}: {sorted(undocumented)} are in no table or text"


def test_every_variable_the_docs_name_is_read_by_the_settings_or_the_deployment_files():
    named = set(re.findall(r"SHARDTRAIN_[A-Z_]*[A-Z](?![A-Z_])", OPERATIONS)) - {"SHARDTRAIN_TLS"}  # TLS_* is several
    sources = SETTINGS + "".join(path.read_text() for path in (ROOT / "docker").rglob("*") if path.is_file())
    read = {f"SHARDTRAIN_{name}" for name in re.findall(r'_env\(env, "([A-Z_]+)"', sources)} | \
        set(re.findall(r"SHARDTRAIN_[A-Z_]*[A-Z]", sources))
    assert named <= read, f"docs name variables nothing reads: {sorted(named - read)}"


class Reads(dict):
    """An environment that records which variables a parser looked up."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("heading", list(PARSERS))
def test_every_help_line_names_a_variable_the_parser_reads(heading):
    env = Reads()
    parser = PARSERS[heading](env)
    for action in parser._actions:
        if "--help" in action.option_strings:
            continue
        named = set(re.findall(r"SHARDTRAIN_[A-Z0-9_]+", action.help or ""))
        assert named, f"{action.option_strings[0]}: its help names no variable"
        assert named <= env.read, (action.option_strings[0], named - env.read)
