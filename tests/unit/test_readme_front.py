"""README.md's front door: what Sweeper is, then the two commands (run the service, run the
tests), as a newcomer reads them on a fresh clone; `.ci/run` runs exactly the second."""

from __future__ import annotations

import shlex

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
SERVE = ("python3 -m venv .venv && .venv/bin/pip install -e '.[local]' && "
         ".venv/bin/sweeper serve")
TEST = "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/pytest"


def test_the_readme_says_what_sweeper_is_then_gives_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    intro, _, rest = text.partition("```sh\n")
    assert intro.startswith("# Sweeper\n\nSweeper runs scheduled data cleanup"), intro[:200]
    assert "## " not in intro and ".ci/run" not in intro  # what it is comes first
    assert rest.split("```", 1)[0] == f"{SERVE}\n{TEST}\n"
    # what each gives, before any other section: the bare service (401 on /v1), the ready
    # one (`sweeper local`), and what the tests run against
    said = rest.split("```", 1)[1].split("\n## ", 1)[0]
    for words in ("401", "sweeper local", "SWEEPER_TEST_DATABASE_URL", ".ci/run"):
        assert words in said, words


def test_ci_runs_the_readme_test_command() -> None:
    """The commands of .ci/run that make the environment and run the tests are the README's
    second command's (flags aside), and the suite is run with no argument."""
    script = (REPO_ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    ci = [shlex.split(line) for line in script.splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    steps = [shlex.split(step) for step in TEST.split(" && ")]
    assert steps[0] in ci  # python3 -m venv .venv
    installs = [c for c in ci if c[:2] == [".venv/bin/pip", "install"] and "-e" in c]
    assert [c[c.index("-e"):] for c in installs] == [steps[1][2:]]  # -e .[dev]
    runs = [c[c.index(".venv/bin/pytest"):] for c in ci if ".venv/bin/pytest" in c]
    assert runs == [steps[2]], runs  # the whole suite: no argument
