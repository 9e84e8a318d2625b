"""The README's quick-start commands are the ones CI runs and the ones that work."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```sh\n")[1:]
    return [b.split("\n```", 1)[0].strip() for b in blocks]


def test_ci_runs_the_readme_test_command():
    commands = quick_start_commands()
    [install_and_run] = [c for c in commands if "berth generate" in c]
    [install_and_test] = [c for c in commands if "pytest" in c]
    assert "berth generate examples/requests.jsonl" in install_and_run
    assert "pytest" in install_and_test
    assert install_and_test in ROOT.joinpath(".ci", "run").read_text()
    assert ROOT.joinpath("examples", "requests.jsonl").exists()
