"""Settings: config.yaml documents the defaults exactly; env and flags override one to one."""
import dataclasses
import os

import pytest
import yaml

from chat.settings import SECTIONS, Settings, load_settings
from engine.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_repo_config_yaml_equals_defaults():
    data = yaml.safe_load(open(os.path.join(ROOT, "config.yaml")))
    defaults = Settings()
    assert set(data) == set(SECTIONS)
    for section in SECTIONS:
        assert data[section] == dataclasses.asdict(getattr(defaults, section)), section


def test_repo_config_yaml_loads():
    assert load_settings(os.path.join(ROOT, "config.yaml"), env={}) == Settings()


def test_env_then_flags_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("sampling:\n  temperature: 0.3\n")
    s = load_settings(str(f), env={"CHAT_TEMPERATURE": "0.4", "CHAT_TOP_K": "5", "CHAT_CUDA_GRAPH": "0"},
                      overrides={"top_k": "9"})
    assert s.sampling.temperature == 0.4 and s.sampling.top_k == 9 and s.engine.cuda_graph == "off"


def test_bad_values_name_key_and_allowed():
    with pytest.raises(ConfigError, match="top_p: 1.5 is not valid; allowed: a number > 0.0"):
        load_settings(None, env={}, overrides={"top_p": "1.5"})
    with pytest.raises(ConfigError, match="markdown: 'perhaps'"):
        load_settings(None, env={}, overrides={"markdown": "perhaps"})


def test_with_value_validates():
    s = Settings().with_value("temperature", "0")
    assert s.sampling.greedy
    with pytest.raises(ConfigError):
        s.with_value("nonsense", "1")


def test_unquoted_yaml_on_off_reads_as_the_choice(tmp_path):
    """YAML 1.1 parses `cuda_graph: off` as False: a choice of on | off takes it as 'off'."""
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  cuda_graph: off\n  compile: on\n  quantized: off\n")
    s = load_settings(str(f), env={})
    assert (s.engine.cuda_graph, s.engine.compile, s.engine.quantized) == ("off", "on", "off")
    f.write_text("engine:\n  dtype: off\n")
    with pytest.raises(ConfigError, match="dtype: False is not valid"):
        load_settings(str(f), env={})


def test_zero_and_one_switch_every_on_off_setting():
    s = load_settings(None, env={"CHAT_CPU_KERNEL": "0", "CHAT_COMPILE": "1", "CHAT_QUANTIZED": "false"})
    assert (s.engine.cpu_kernel, s.engine.compile, s.engine.quantized) == ("off", "on", "off")
    assert load_settings(None, env={"CHAT_QUANTIZED": "1"}).engine.quantized == "on"
    with pytest.raises(ConfigError, match="quantized: 'sometimes' is not valid"):
        load_settings(None, env={"CHAT_QUANTIZED": "sometimes"})
