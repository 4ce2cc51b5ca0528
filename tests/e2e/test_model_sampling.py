"""The model's own sampling defaults: an HF directory's generation_config.json and a GGUF's
general.sampling.* keys are the defaults for that model, under config files, CHAT_* variables,
flags and /set; /show names where each value came from; a value out of its domain is a note,
not an error; another model's defaults replace them on /model; replays keep their recorded
sampling."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q

from chat.settings import Settings, load_settings


@pytest.fixture(scope="module")
def with_generation_config(tiny_dirs, tmp_path_factory):
    """The tiny llama checkpoint with a generation_config.json of temperature 0.6, top_k 20."""
    import shutil
    src = tiny_dirs["llama"][0]
    dst = str(tmp_path_factory.mktemp("gen") / "llama")
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 7.0, "eos_token_id": 2}, f)
    return dst


def runtime(model, **flags):
    from chat.runtime import open_runtime
    return open_runtime(load_settings(env={}, overrides={"model": model, "device": "cpu", **flags}))


def test_generation_config_is_the_models_default(with_generation_config):
    rt = runtime(with_generation_config)
    s = rt.settings
    assert (s.sampling.temperature, s.sampling.top_k) == (0.6, 20)
    assert s.origin("temperature") == s.origin("top_k") == "the model's generation_config.json"
    assert s.sampling.top_p == 0.95 and s.origin("top_p") == "default"  # 7.0 is out of (0, 1]: a note
    assert any("generation_config.json gives" in n and "top_p" in n and "not used" in n for n in rt.loaded.notes)


def test_a_flag_and_a_variable_win(with_generation_config):
    from chat.runtime import open_runtime
    s = open_runtime(load_settings(env={"CHAT_TOP_K": "5"}, overrides={
        "model": with_generation_config, "device": "cpu", "temperature": "0"})).settings
    assert (s.sampling.temperature, s.sampling.top_k) == (0.0, 5)
    assert s.origin("temperature") == "--temperature" and s.origin("top_k") == "CHAT_TOP_K"


def test_do_sample_false_is_greedy():
    from models.formats.checkpoints import hf_sampling
    assert hf_sampling({"do_sample": False, "temperature": 0.9, "top_p": 0.5}) == {"temperature": 0.0, "top_p": 0.5}
    assert hf_sampling({"temperature": None, "max_length": 20}) == {}


def test_another_models_defaults_replace_them():
    s, notes = Settings().with_model_defaults({"temperature": 0.6, "top_k": 20}, "generation_config.json")
    s = s.with_value("top_p", 0.5)  # /set: the person's, kept across models
    t, _ = s.with_model_defaults({"temperature": 0.3}, "GGUF general.sampling keys")
    assert (t.sampling.temperature, t.sampling.top_k, t.sampling.top_p) == (0.3, 40, 0.5)
    assert t.origin("temperature") == "the model's GGUF general.sampling keys" and t.origin("top_k") == "default"
    assert t.origin("top_p") == "/set" and not notes
    assert t.without_model_defaults().sampling == Settings().with_value("top_p", 0.5).sampling


def test_a_gguf_general_sampling_keys(tmp_path):
    from tests.support.blocks import SIZES
    from tests.support.tiny import hf_model
    from tests.support.tiny_gguf import write_gguf

    import models
    path = write_gguf("llama", str(tmp_path / "s.gguf"), hf_model("llama", **SIZES), Q.Q8_0,
                      metadata={"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                "general.sampling.penalty_repeat": 1.1})
    lm = models.load(path)
    assert lm.sampling_defaults == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    assert lm.sampling_source == "GGUF general.sampling keys"
    assert models.load(path).sampling_defaults == lm.sampling_defaults  # (from the cached index too)


@pytest.mark.slow
def test_show_names_each_values_origin(with_generation_config):
    env = dict(os.environ, CHAT_CONFIG="", XDG_STATE_HOME=os.path.dirname(with_generation_config))
    proc = subprocess.run([sys.executable, "-m", "chat", "--model", with_generation_config, "--device", "cpu",
                           "--min-p", "0.1"], input="/show\n/exit\n", capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("sampling:"))
    assert "temperature=0.6 (the model's generation_config.json)" in line
    assert "top_k=20 (the model's generation_config.json)" in line and "min_p=0.1 (--min-p)" in line
    assert "top_p=0.95," in line  # (a built-in default: no origin named)
