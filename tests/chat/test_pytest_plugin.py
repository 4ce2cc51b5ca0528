"""The pytest plugin: `pytest --chat-recordings PATH` makes each recording a test item."""
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml

from tests.support.paths import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden", "recordings")


def test_the_entry_point_names_the_plugin_module():
    """Named as its module: `-p chat.pytest_plugin` and the autoloaded entry point are then one plugin."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["pytest11"]
    assert eps == {"chat.pytest_plugin": "chat.pytest_plugin"}


def pytest_in(tmp_path, *args):
    """A pytest of someone's own suite (one trivial test) with the plugin and `args`."""
    (tmp_path / "test_own.py").write_text("def test_own():\n    assert True\n")
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # the plugin by -p, installed or not
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "chat.pytest_plugin", "-p", "no:cacheprovider",
                           "-q", "-rA", "--rootdir", str(tmp_path), str(tmp_path / "test_own.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_each_recording_is_an_item_and_a_divergence_fails_it_with_the_report(tmp_path):
    recs = tmp_path / "recs"
    recs.mkdir()
    shutil.copy(os.path.join(GOLDEN, "kv-greedy.yaml"), recs / "kv-greedy.yaml")
    data = yaml.safe_load(open(os.path.join(GOLDEN, "kv-greedy.yaml")))
    last = [e for e in data["events"] if "generated_ids" in e][-1]
    last["generated_ids"][5] = (last["generated_ids"][5] + 7) % 300
    (recs / "tampered.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (recs / "broken.yaml").write_text("format: chat-transcript\nversion: 1\nevents: [\n")
    proc = pytest_in(tmp_path, "--chat-recordings", recs, "--chat-runs", "0")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "2 failed, 2 passed" in out
    assert re.search(r"PASSED \S*recs/kv-greedy.yaml::replay", out) and re.search(r"FAILED \S*recs/tampered.yaml", out)
    assert "divergence in run 1 (fresh session): turn 5 (line" in out and "generated token 5" in out
    assert "malformed YAML" in out and "Traceback" not in out
    # teacher-forced within a margin: the tampered token is a near tie, listed in a report section
    proc = pytest_in(tmp_path, "--chat-recordings", recs, "--chat-runs", "0", "--chat-tolerance", "100",
                     "-k", "not broken")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed, 1 deselected" in proc.stdout and "Captured near ties call" in proc.stdout
    assert "turn 5, token 5: recorded" in proc.stdout


def test_without_the_option_nothing_is_added(tmp_path):
    proc = pytest_in(tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout
