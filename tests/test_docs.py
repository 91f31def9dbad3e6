"""The documentation as a user reads it: every `python cli.py ...` command of README.md and docs/ parses as written,
every relative link leads to a file (and a heading) that exists, and README's reading order names real files."""

import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED_DOCS = [*USER_DOCS, REPO / "DEVELOPERS.md"]

# Commands that read what an earlier run wrote: parsed with --print_config they would only report the missing file.
NEEDS_A_RUN = {
    "python cli.py predict -c logs/seq2seq/default/config.yaml "
    "--ckpt_path logs/seq2seq/default/checkpoints/last.ckpt --data.init_args.predict_path=numbers.txt": (
        "the seq2seq run's own config.yaml"
    ),
}


def fenced_blocks(text: str, languages: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number, body) of each fenced code block whose language is one of ``languages`` ('' for none)."""
    blocks = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.DOTALL | re.MULTILINE):
        if match.group(2) in languages:
            blocks.append((text.count("\n", 0, match.start(3)) + 1, match.group(3)))
    return blocks


def cli_commands() -> list[tuple[str, str]]:
    """(where, command) of every `python cli.py` command in the shell blocks of README.md and docs/."""
    commands = []
    for path in USER_DOCS:
        for first_line, body in fenced_blocks(path.read_text(), ("bash", "sh", "")):
            lines = re.sub(r"\\\n\s*", " ", body).splitlines()
            for offset, line in enumerate(lines):
                if "python cli.py" not in line:
                    continue
                words = shlex.split(line, comments=True)
                starts = [0] + [i + 1 for i, word in enumerate(words) if word in ("&&", "||", ";", "|")]
                for start in starts:
                    program = words[start:]
                    while program and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", program[0]):
                        program = program[1:]
                    if program[:2] == ["python", "cli.py"]:
                        end = next((i for i, word in enumerate(program) if word in ("&&", "||", ";", "|")), None)
                        command = words[start : len(words) - len(program)] + program[:end]
                        commands.append((f"{path.relative_to(REPO)}:{first_line + offset}", shlex.join(command)))
    return commands


FIRST_PLACE = {}  # a command given on two pages is parsed once, named by where it comes first
for where, command in cli_commands():
    FIRST_PLACE.setdefault(command, where)
COMMANDS = [(where, command) for command, where in FIRST_PLACE.items()]


@pytest.fixture(scope="module")
def my_pkg(tmp_path_factory) -> Path:
    """README's own `my_pkg/__init__.py`, as a user would save it beside cli.py."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("\n## Your own model\n") :]
    section = section[: section.index("\n## ", 1)]
    ((_, source),) = fenced_blocks(section, ("python",))
    root = tmp_path_factory.mktemp("user")
    (root / "my_pkg").mkdir()
    (root / "my_pkg" / "__init__.py").write_text(source)
    return root


def test_the_docs_hold_the_commands_this_test_knows():
    assert len(COMMANDS) >= 20, COMMANDS  # the extraction found the docs' commands
    assert any("--model my_pkg.MyModel --data my_pkg.MyData" in command for _, command in COMMANDS)
    assert set(NEEDS_A_RUN) <= {command for _, command in COMMANDS}, "an exception names a command the docs lost"


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_cli_command_of_the_docs_parses(where, command, my_pkg, monkeypatch, capsys):
    if command in NEEDS_A_RUN:
        pytest.skip(f"needs a run's output: {NEEDS_A_RUN[command]}")
    import cli

    words = shlex.split(command)
    for word in words[: words.index("python")]:
        name, value = word.split("=", 1)
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(my_pkg))
    monkeypatch.setattr(sys, "argv", ["cli.py", *words[words.index("cli.py") + 1 :], "--print_config"])
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code in (0, None), f"{where}: {command}\n{capsys.readouterr().err}"


def github_anchor(heading: str) -> str:
    """The #fragment GitHub gives a heading: markup and punctuation dropped, lower case, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("\\", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def outside_code_blocks(text: str) -> str:
    return re.sub(r"^( *)```.*?^\1```", "", text, flags=re.DOTALL | re.MULTILINE)


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code, where a link is a link."""
    return re.sub(r"`[^`\n]*`", "code", outside_code_blocks(text))


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", outside_code_blocks(path.read_text()), re.MULTILINE):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def relative_links(path: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text()))
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("path", LINKED_DOCS, ids=[str(path.relative_to(REPO)) for path in LINKED_DOCS])
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(path):
    broken = []
    for target in relative_links(path):
        file, _, fragment = target.partition("#")
        destination = (path.parent / file).resolve() if file else path
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif fragment and fragment not in anchors(destination):
            broken.append(f"{target}: no heading #{fragment} in {destination.relative_to(REPO)}")
    assert relative_links(REPO / "README.md"), "no link found: the pattern is wrong"
    assert broken == [], f"{path.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("path", LINKED_DOCS, ids=[str(path.relative_to(REPO)) for path in LINKED_DOCS])
def test_every_file_of_the_project_the_docs_name_exists(path):
    # Code spans such as `training/run_lock.py` or `configs/elastic.yaml`: a moved or renamed file leaves them stale.
    named = re.findall(
        r"`((?:benchmarks|configs|data|models|scripts|tests|training)/[\w/.-]+\.(?:py|sh|yaml|sbatch|env))`",
        path.read_text(),
    )
    assert sorted({name for name in named if not (REPO / name).is_file()}) == []


def test_every_file_of_the_reading_order_exists():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("\n## Reading the code\n") :]
    section = section[: section.index("\n## ", 1)]
    steps = re.findall(r"^\d+\. \[[^\]]*\]\(([^)#]+)\)", section, re.MULTILINE)
    assert len(steps) >= 4, section
    assert [step for step in steps if not (REPO / step).is_file()] == []


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.split()) <= 2500
    headings = [line for line in readme.splitlines()[:80] if line.startswith("## ")]
    assert headings[:2] == ["## Two commands", "## Your own model"]
