"""The command line a newcomer meets: `kvharness --help` lists what can be run; the console script exists."""
import sys
from pathlib import Path

from harness import __main__ as entry
from harness.running.catalog import entries


def test_help_lists_experiments_systems_and_tasks(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["kvharness", "--help"])
    entry.cli()
    out = capsys.readouterr().out
    for group in ("exp", "system", "task"):
        for name, text in entries(group):
            assert text, f"conf/{group}/{name}.yaml needs a first comment line describing it"
            assert f"  {name} " in out
    assert "+exp=NAME" in out and "python -m harness.report" in out


def test_console_scripts_are_installed():
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "kvharness").is_file(), "run `make setup` (pip install -e .) to install the kvharness command"


def test_console_script_finds_the_configs_from_any_folder(tmp_path):
    import subprocess
    proc = subprocess.run([str(Path(sys.executable).parent / "kvharness"), "+exp=quickstart", "--cfg", "job"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "name: quickstart" in proc.stdout
