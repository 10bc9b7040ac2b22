"""The README's Quick start commands stay true to what CI and the CLI run."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _quick_start_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, re.S)


def test_quick_start_has_two_one_line_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands)
    assert "keras-hub-dist validate" in commands[0]
    assert "--devices 8" in commands[0] and "pytest" in commands[1]


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = _quick_start_commands()[1]
    assert test_command in ci_lines


def test_console_script_is_declared():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'keras-hub-dist = "keras_hub_dist.cli.main:main"' in pyproject
