"""Settings: config.yaml documents the defaults exactly; env and flags override one to one."""
import dataclasses
import os

import pytest
import yaml

from chat.settings import SECTIONS, Settings, load_settings
from engine.config import ConfigError

from tests.support.paths import ROOT


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


def test_the_environment_is_read_once_into_its_dataclass():
    """engine/config.py's Environment: README's diagnosis switches, the cache folder and the
    compiler; a bad switch value names the variable and what it takes."""
    from engine.config import Environment, environment
    home = os.path.expanduser("~")
    assert environment({}) == environment({"CHAT_PDL": " ", "CHAT_FP8_GEMV": ""}) == Environment(
        cache_dir=os.path.join(home, ".cache", "chat"))  # (an exported but empty variable: unset)
    env = environment({"CHAT_TRITON": "0", "CHAT_PDL": "off", "CHAT_PRECOMPILE": "false", "CHAT_FP8_PREFILL": "Dequant",
                       "CHAT_FP8_GEMV": "f32", "XDG_CACHE_HOME": "/c", "CXX": "clang++"})
    assert env == Environment(triton=False, pdl=False, precompile=False, fp8_prefill="dequant", fp8_gemv="f32",
                              cache_dir="/c/chat", compiler="clang++")
    for name, bad, allowed in (("CHAT_TRITON", "maybe", "1 | 0"), ("CHAT_FP8_GEMV", "f64", "f16 | f32")):
        with pytest.raises(ConfigError, match=f"^{name}: 'maybe'|^{name}: 'f64'") as e:
            environment({name: bad})
        assert allowed in str(e.value) and e.value.key == name


def test_configure_process_hands_the_environment_to_the_kernels():
    from engine.config import environment
    from engine.device import configure_process, kernel_config
    from engine.config import EngineConfig
    from models.formats import checkpoints
    from models.kernels.cpu import step
    from models.kernels.cuda import base, fp8, fp8_gemm
    env = environment({"CHAT_TRITON": "0", "CHAT_PDL": "0", "CHAT_FP8_PREFILL": "dequant", "CHAT_FP8_GEMV": "f32",
                       "XDG_CACHE_HOME": "/tmp/somewhere", "CXX": "c++"})
    configure_process(env)  # (the suite's fixture restores each switch after the test)
    assert (base.ENABLED, base.PDL_ENABLED, base.PRECOMPILE_ENABLED) == (False, False, True)
    assert (fp8_gemm.MODE, fp8.FORM, step.COMPILER) == ("dequant", "f32", "c++")
    assert step.library_path().startswith("/tmp/somewhere/chat/cpu_step-")
    assert checkpoints.INDEX_DIR == "/tmp/somewhere/chat/gguf-index"
    assert kernel_config(EngineConfig(), env).triton is False
    assert kernel_config(EngineConfig(), environment({})).triton is None


def test_a_kernel_switch_changes_only_itself_and_puts_back():
    from models import kernels
    from models.kernels.cuda import base, fp8
    start = kernels.switches()
    before = kernels.switch(precompile=False, fp8_gemv="f32")
    assert before == start and kernels.switches() == {**start, "precompile": False, "fp8_gemv": "f32"}
    assert base.PRECOMPILE_ENABLED is False and fp8.FORM == "f32"
    kernels.switch(triton=True)  # (Triton absent: still off)
    assert kernels.switches()["triton"] == (base.triton is not None)
    for bad in ({"tritn": False}, {"fp8_gemv": "f8"}):
        with pytest.raises(ValueError) as e:
            kernels.switch(**bad)
        assert next(iter(bad)) in str(e.value) or "f8" in str(e.value)
    kernels.switch(**before)
    assert kernels.switches() == start


@pytest.mark.slow
def test_a_bad_diagnosis_switch_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys
    env = dict(os.environ, CHAT_PDL="sometimes", XDG_STATE_HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "chat", "--prompt", "hi", "--max-new-tokens", "1"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["chat: error: CHAT_PDL: 'sometimes' is not valid; allowed: 1 | 0 "
                                             "(true | false, on | off)"], r.stderr
