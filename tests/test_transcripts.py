"""Transcripts: golden recordings replay token for token; divergences and bad files are reported."""
import glob
import os
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from chat import transcript as tr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "recordings")
RECORDINGS = sorted(glob.glob(os.path.join(GOLDEN, "*.yaml")))


def chat(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "chat", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("path", RECORDINGS, ids=os.path.basename)
def test_golden_recording_replays_identically(path):
    runs = "1" if "smollm2" in path else "3"
    proc = chat("replay", path, "--runs", runs)
    assert proc.returncode == 0, proc.stderr
    assert "replay identical" in proc.stdout


def test_golden_set_covers_kv_hybrid_greedy_and_seeded():
    names = {os.path.basename(p) for p in RECORDINGS}
    assert {"kv-greedy.yaml", "kv-seeded.yaml", "hybrid-greedy.yaml", "hybrid-seeded.yaml",
            "smollm2-greedy.yaml"} <= names


def test_record_then_replay_on_fresh_script(tmp_path):
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nmodel: {source: tests/golden/tiny-qwen3_5}\n"
                      "sampling: {temperature: 0.7, seed: 9, max_new_tokens: 10}\n"
                      "events:\n  - user: one\n  - user: two\n    set: {temperature: 0}\n")
    rec = tmp_path / "r.yaml"
    proc = chat("run", str(script), "-o", str(rec))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) >= 1
    proc = chat("replay", str(rec), "--runs", "3")
    assert proc.returncode == 0, proc.stderr


def test_altered_token_reports_turn_and_index(tmp_path):
    data = yaml.safe_load(open(os.path.join(GOLDEN, "kv-greedy.yaml")))
    turns = [e for e in data["events"] if "generated_ids" in e]
    turns[1]["generated_ids"][3] = (turns[1]["generated_ids"][3] + 1) % 300
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = chat("replay", str(bad))
    assert proc.returncode == 1, proc.stderr
    assert "turn 2" in proc.stderr and "generated token 3" in proc.stderr
    assert "top-5" in proc.stderr and "expected" in proc.stderr and "actual" in proc.stderr


def test_fingerprint_mismatch_is_exit_2_unless_allowed(tmp_path):
    data = yaml.safe_load(open(os.path.join(GOLDEN, "kv-greedy.yaml")))
    data["model"]["fingerprint"] = "sha256:" + "0" * 64
    f = tmp_path / "other.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = chat("replay", str(f))
    assert proc.returncode == 2 and "fingerprint" in proc.stderr and "Traceback" not in proc.stderr
    assert chat("replay", str(f), "--allow-model-change").returncode == 0


def test_malformed_file_names_line(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("format: chat-transcript\nversion: 1\nevents:\n  - user: hi\n  - usr: typo\n")
    proc = chat("run", str(f))
    assert proc.returncode == 2
    assert f"{f}:5:" in proc.stderr and "unknown key 'usr'" in proc.stderr and "Traceback" not in proc.stderr
    f.write_text("format: chat-transcript\nversion: 1\nevents: [\n")
    proc = chat("run", str(f))
    assert proc.returncode == 2 and "malformed YAML" in proc.stderr


def test_writes_are_atomic(tmp_path):
    target = tmp_path / "out.yaml"
    target.write_text("old")

    with pytest.raises(TypeError):
        tr.write_atomic(str(target), 123)  # the write fails midway
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.yaml"]  # no temp file left behind


VALID = open(os.path.join(GOLDEN, "kv-greedy.yaml"), encoding="utf-8").read()
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**20), st.floats(allow_nan=True),
                    st.text(max_size=20), st.lists(st.integers(-3, 400), max_size=5))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)


def _parse_never_crashes(text):
    try:
        tr.parse(text, "fuzz.yaml")
    except tr.TranscriptError as e:
        assert "\n" not in str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400))
def test_fuzz_random_text(text):
    _parse_never_crashes(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_recordings(data):
    doc = yaml.safe_load(VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        target = doc
        path = []
        while isinstance(target, (dict, list)) and target and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(target) if isinstance(target, dict) else range(len(target))))
            path.append(key)
            target = target[key]
        if path:
            parent = doc
            for k in path[:-1]:
                parent = parent[k]
            if data.draw(st.booleans()):
                parent[path[-1]] = data.draw(values)
            elif isinstance(parent, dict):
                del parent[path[-1]]
    _parse_never_crashes(yaml.safe_dump(doc))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_bytes_through_load(tmp_path_factory, raw):
    f = tmp_path_factory.mktemp("fz") / "f.yaml"
    f.write_bytes(raw)
    try:
        tr.load(str(f))
    except tr.TranscriptError:
        pass


def test_recordings_from_before_the_quantized_setting_replay_on_the_dequantized_path(tmp_path):
    """Recordings made before `quantized` existed ran on dequantized weights: they replay on
    that path; new recordings carry the setting; scripts without it take the default."""
    from chat.__main__ import build_replay_parser, settings_for
    src = os.path.join(GOLDEN, "smollm2-greedy.yaml")
    data = yaml.safe_load(open(src, encoding="utf-8"))
    assert data["engine"]["quantized"] == "auto"
    del data["engine"]["quantized"]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data), encoding="utf-8")
    args = build_replay_parser().parse_args([str(old)])
    assert settings_for(args, tr.load(str(old))).engine.quantized == "off"
    assert settings_for(args, tr.load(src)).engine.quantized == "auto"
    script = tr.load(os.path.join(ROOT, "tests", "golden", "scripts", "smollm2-greedy.yaml"))
    assert settings_for(args, script).engine.quantized == "auto"
