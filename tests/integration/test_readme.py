"""The README and docs/ stay true: commands parse, tables match the code, CI runs the test line.

* The README is the front door: under `README_MAX_LINES` lines, it links
  every page of docs/, and its test command is exactly the line ``.ci/run``
  runs, inside a ```bash block.
* Every ``evtrain ...`` command in a shell block of the README or a docs page
  (also ``python -m evtrain`` and ``docker compose run SERVICE ...`` of an
  evtrain service) is accepted by the real argument parser (run with
  ``--help`` appended); every script it names (``python bench/x.py``) and
  every repository file the pages name exists; every relative link resolves,
  to a file and, with ``#anchor``, to one of its headings.
* In docs/reference.md the event table is generated from
  `evtrain.events.MESSAGE_TYPES` row by row, every exposed metric family
  (scraped from a live exporter) is in the metrics table, the CLI table lists
  exactly the CLI's subcommands and the Job table exactly `evtrain.job.Job`'s
  fields, defaults and override flags. docs/architecture.md's package map
  names every package and only files that exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from helpers.deploy_helpers import compose_config, exporter_exposition

from evtrain.cli import COMMANDS, build_parser
from evtrain.events import MESSAGE_TYPES, Message
from evtrain.exporters.prometheus_catalogue import CATALOGUE
from evtrain.job import Job
from evtrain.overrides import OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
ARCHITECTURE = DOCS / "architecture.md"
README_MAX_LINES = 250
"""The README is the front door; the rest of the documentation lives in docs/."""
CI_RUN = ROOT / ".ci" / "run"
MAIN_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && "
    "pip install -q -e '.[demo]' && evtrain demo"
)
"""The README's main command, kept verbatim."""
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}


def readme() -> str:
    return README.read_text()


def doc_pages() -> list[Path]:
    """The README and every page of docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def shell_lines(text: str) -> list[str]:
    """Command lines of the shell blocks (continuations joined, prompts stripped)."""
    lines = []
    for language, body in code_blocks(text):
        if language in SHELL_LANGUAGES:
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if line and not line.startswith("#"):
                    lines.append(line)
    return lines


def commands(line: str) -> list[list[str]]:
    """The simple commands of one line (split at ``&&``, ``||``, ``;``, ``|``)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    for token in lexer:
        if set(token) <= set(";&|"):
            out.append([])
        else:
            out[-1].append(token)
    # Leading VAR=value assignments are not the command.
    return [
        cmd[next((i for i, t in enumerate(cmd) if not re.match(r"^\w+=", t)), len(cmd)) :]
        for cmd in out
        if cmd
    ]


def compose_evtrain_services() -> set[str]:
    """Services of docker-compose.yml that run the evtrain image (built here)."""
    return {n for n, s in compose_config()["services"].items() if "build" in s}


def compose_run_service(cmd: list[str]) -> tuple[str, list[str]] | None:
    """(service, arguments) of ``docker compose run [OPTIONS] SERVICE ARGS...``."""
    if cmd[:3] != ["docker", "compose", "run"]:
        return None
    rest = cmd[3:]
    while rest and rest[0].startswith("-"):
        rest = rest[1:]
    return (rest[0], rest[1:]) if rest else None


def evtrain_argv(cmd: list[str]) -> list[str] | None:
    """The evtrain arguments of a command line (None if it does not run evtrain).

    ``docker compose run SERVICE ARGS`` counts (the image's entrypoint is
    evtrain); `test_readme_compose_runs_evtrain_services` checks the service.
    """
    if cmd[0] == "evtrain":
        return cmd[1:]
    if cmd[:3] in (["python", "-m", "evtrain"], ["python3", "-m", "evtrain"]):
        return cmd[3:]
    if (run := compose_run_service(cmd)) is not None:
        return run[1]
    return None


def page_commands(page: Path) -> list[list[str]]:
    return [cmd for line in shell_lines(page.read_text()) for cmd in commands(line)]


def docs_commands() -> list[list[str]]:
    """The shell commands of the README and every docs page."""
    return [cmd for page in doc_pages() for cmd in page_commands(page)]


def docs_evtrain_commands() -> list[list[str]]:
    return [argv for cmd in docs_commands() if (argv := evtrain_argv(cmd)) is not None]


def section(title: str, page: Path = REFERENCE) -> str:
    """The text of ``page`` under ``## title`` up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page.read_text(), re.M | re.S)
    assert match is not None, f"{page_name(page)} has no section '## {title}'"
    return match.group(1)


# ------------------------------------------------------------------ the two commands


def ci_test_line() -> str:
    """The command .ci/run ends with: the README's test command."""
    lines = [line.strip() for line in CI_RUN.read_text().splitlines() if line.strip()]
    return lines[-1]


def test_readme_has_ci_test_command_in_a_bash_block() -> None:
    line = ci_test_line()
    assert "pytest" in line
    blocks = [body for language, body in code_blocks(readme()) if language == "bash"]
    assert any(line in body.splitlines() for body in blocks), (
        f"README must contain, in a ```bash block, exactly the line .ci/run runs:\n{line}"
    )


def test_readme_has_the_main_command_in_a_bash_block() -> None:
    blocks = [body for language, body in code_blocks(readme()) if language == "bash"]
    assert any(MAIN_COMMAND in body.splitlines() for body in blocks)
    # Both start the same way: one install recipe, two extras.
    install = "pip install -q -e"
    assert MAIN_COMMAND.split(install)[0] == ci_test_line().split(install)[0]


# ------------------------------------------------------------------ every command runs


def test_command_extraction() -> None:
    assert commands("a=1 evtrain x --y 'z w' && . f; b | evtrain c # note") == [
        ["evtrain", "x", "--y", "z w"],
        [".", "f"],
        ["b"],
        ["evtrain", "c"],
    ]
    assert evtrain_argv(["python", "-m", "evtrain", "bus"]) == ["bus"]
    assert evtrain_argv(["docker", "compose", "run", "--rm", "trainer", "ckpt"]) == ["ckpt"]
    assert evtrain_argv(["pip", "install"]) is None


def test_docs_show_many_commands() -> None:
    found = docs_evtrain_commands()
    subcommands = {argv[0] for argv in found if argv}
    # Catches an extraction that silently finds nothing.
    assert len(found) >= 15, found
    assert {"demo", "launch", "hook", "bus", "events", "replay", "timeline", "ckpt"} <= subcommands
    in_readme = {argv[0] for cmd in page_commands(README) if (argv := evtrain_argv(cmd))}
    assert {"demo", "launch"} <= in_readme, in_readme


@pytest.mark.parametrize(
    "argv", docs_evtrain_commands(), ids=lambda argv: " ".join(argv)[:60] or "(none)"
)
def test_docs_evtrain_command_is_accepted(argv: list[str]) -> None:
    """argparse accepts the command: subcommand, flags and the number of arguments."""
    out = io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
        pytest.raises(SystemExit) as exit_info,
    ):
        build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0, f"evtrain {shlex.join(argv)}:\n{out.getvalue()}"
    assert out.getvalue().startswith(f"usage: evtrain {argv[0]}")


def test_docs_compose_runs_evtrain_services() -> None:
    runs = [run for cmd in docs_commands() if (run := compose_run_service(cmd)) is not None]
    assert runs
    for service, _ in runs:
        assert service in compose_evtrain_services(), f"{service} does not run the evtrain image"


def test_docs_scripts_exist() -> None:
    scripts = [
        (page, cmd[1])
        for page in doc_pages()
        for cmd in page_commands(page)
        if cmd[0] in ("python", "python3") and len(cmd) > 1 and cmd[1].endswith(".py")
    ]
    assert any(s.startswith("bench/") for _, s in scripts)
    for page, script in scripts:
        assert (ROOT / script).is_file(), f"{page_name(page)} runs {script}, which does not exist"


def test_docs_files_exist() -> None:
    """Repository files the README and docs pages name (examples, deploy, Dockerfile...)."""
    quoted = r"`((?:examples|deploy|bench|docs)/[\w./-]+|Dockerfile|docker-compose\.yml)`"
    everything: set[str] = set()
    for page in doc_pages():
        text = page.read_text()
        named = set(re.findall(quoted, text))
        named |= {m for _, m in re.findall(r"(\w+\.)?((?:examples|bench)/[\w-]+\.py)", text)}
        everything |= named
        for name in sorted(named):
            if name.startswith("docs/") and not name.endswith(".md"):
                continue  # pictures are drawn from real runs, not by the tests
            assert (ROOT / name).exists(), f"{page_name(page)} names {name}, which does not exist"
    assert "examples/loss_spike_guard.py" in everything


# ------------------------------------------------------------------ the front door and its links


def headings_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        unique, n = slug, 0
        while unique in anchors:
            n += 1
            unique = f"{slug}-{n}"
        anchors.add(unique)
    return anchors


def relative_links(text: str) -> list[str]:
    """Targets of the page's Markdown links and images that are not URLs."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"^[a-z]+:", t)]


def test_anchor_slugs() -> None:
    assert headings_anchors(
        "# A\n## Data parallel \u00d7 pipeline parallel\n```\n# not a heading\n```\n"
        "## Watching a run: `evtrain top`\n## A\n"
    ) == {"a", "data-parallel--pipeline-parallel", "watching-a-run-evtrain-top", "a-1"}
    assert relative_links("[x](docs/a.md#b) ![p](p.png) [u](https://e.org)") == [
        "docs/a.md#b",
        "p.png",
    ]


def test_readme_is_the_front_door() -> None:
    lines = readme().splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines; it stays under {README_MAX_LINES}: "
        "move details to a page in docs/"
    )
    linked = {(README.parent / t.split("#")[0]).resolve() for t in relative_links(readme())}
    pages = sorted(DOCS.glob("*.md"))
    assert pages
    for page in pages:
        assert page.resolve() in linked, f"README.md does not link {page_name(page)}"


@pytest.mark.parametrize("page", doc_pages(), ids=page_name)
def test_relative_links_resolve(page: Path) -> None:
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page_name(page)} links {target}: no such file"
        if anchor:
            assert anchor in headings_anchors(file.read_text()), (
                f"{page_name(page)} links {target}: {file.name} has no heading '#{anchor}'"
            )


# ------------------------------------------------------------------ tables


def event_row(message_type: type[Message]) -> str:
    """The event-catalogue row of one message type."""
    envelope = set(Message.__struct_fields__)
    fields = [f for f in message_type.__struct_fields__ if f not in envelope]
    topic = message_type.topic.decode()
    return f"| `{topic}` | `{message_type.__name__}` | {', '.join(fields)} |"


def test_event_catalogue_is_generated_from_the_schema() -> None:
    table = section("Event catalogue")
    expected = [event_row(t) for t in MESSAGE_TYPES]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows == expected, "the table should read:\n" + "\n".join(expected)
    for envelope_field in Message.__struct_fields__:
        assert f"`{envelope_field}`" in table


def test_metrics_table_lists_every_exposed_family() -> None:
    table = section("Metrics")
    listed = re.findall(r"^\| `(evtrain_\w+)` \| (\w+) \|", table, re.M)
    exposition = exporter_exposition()
    exposed = {name: exposition.families[name] for name in exposition.user_families}
    assert dict(listed) == exposed, (
        f"missing: {sorted(set(exposed) - dict(listed).keys())}, "
        f"not exposed: {sorted(dict(listed).keys() - set(exposed))}, "
        f"wrong type: {sorted(n for n, t in listed if n in exposed and exposed[n] != t)}"
    )


def test_metrics_table_is_the_catalogue() -> None:
    expected = [
        f"| `{m.exposed}` | {m.kind} | {', '.join(m.labels) or '-'} | {m.meaning} |"
        for m in CATALOGUE
    ]
    rows = [line for line in section("Metrics").splitlines() if line.startswith("| `")]
    assert rows == expected, "the table should read:\n" + "\n".join(expected)


def test_cli_table_lists_every_subcommand() -> None:
    table = section("Command line")
    listed = re.findall(r"^\| `evtrain (\w+)` \|", table, re.M)
    assert len(listed) == len(set(listed))
    assert set(listed) == set(COMMANDS), (
        f"not in docs/reference.md: {sorted(set(COMMANDS) - set(listed))}, "
        f"not a command: {sorted(set(listed) - set(COMMANDS))}"
    )
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for choice in sub._choices_actions:  # the one-line descriptions are the CLI's own
        assert f"| `evtrain {choice.dest}` | {choice.help} |" in table, choice.dest


def job_default(field: dataclasses.Field) -> str:
    """A Job field's default as the reference's table writes it."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return "`" + repr(value).replace("'", '"') + "`"


def test_job_table_lists_every_field() -> None:
    table = section("Job fields")
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \| ([^|]*?) \| .+ \|$", table, re.M)
    fields = [f for f in dataclasses.fields(Job) if f.init]
    assert [name for name, _, _ in rows] == [f.name for f in fields], (
        "the table should list, in order: " + ", ".join(f.name for f in fields)
    )
    flags = {o.field: f"`--{o.flag}`" for o in OVERRIDES.values()}
    for (name, default, flag), field in zip(rows, fields, strict=True):
        assert default == job_default(field), f"{name}: default should read {job_default(field)}"
        assert flag == flags.get(name, ""), f"{name}: override should read {flags.get(name, '')!r}"


def test_package_map_names_every_package_and_real_files() -> None:
    table = section("Package map", ARCHITECTURE)
    rows = re.findall(r"^\| `([\w.]+)` \(`([\w/]+)/`\) \| (.+) \|$", table, re.M)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setuptools["package-dir"]
    expected = {
        package: dirs.get(package, package.replace(".", "/")) for package in setuptools["packages"]
    }
    assert {package: folder for package, folder, _ in rows} == expected
    for package, folder, text in rows:
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", text):
            assert (ROOT / folder / name).exists(), f"{package}: {folder}/{name} does not exist"
