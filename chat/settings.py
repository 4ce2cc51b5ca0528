"""Settings: config.yaml sections → validated dataclasses, with env and flag overrides.

Precedence, lowest first: the defaults (identical to the repo's config.yaml, a test checks), a user
file (--config PATH, $CHAT_CONFIG, or $XDG_CONFIG_HOME/chat/config.yaml), CHAT_<KEY> environment
variables, then --<key> flags. Keys are unique across sections, so each maps one to one to a flag
and a variable. YAML is read as safe_load reads it, a duplicate key refused (chat/yaml_lines.py); errors name the
file and line (or the variable, or the flag), the key and the allowed values.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import yaml

from engine.config import (ConfigError, EngineConfig, SamplingConfig, _Validated, _bool, _choice, _int, _path, _str,
                           build, key_text, setting)

from . import yaml_lines
from .input_files import InputFileError, read_text
from .yaml_lines import YamlShapeError


@dataclass(frozen=True)
class UIConfig(_Validated):
    system_prompt: str = setting("", _str(1 << 20, "text of at most 1048576 characters"))
    markdown: bool = setting(True, _bool())
    show_stats: bool = setting(True, _bool())
    color: str = setting("auto", _choice("auto", "always", "never"))
    history_file: str = setting("", _path("a file path, or \"\" for $XDG_STATE_HOME/chat/history"))
    conversations_dir: str = setting("", _path("a directory, or \"\" for $XDG_STATE_HOME/chat/conversations"))
    keep_conversations: int = setting(100, _int(0, 1_000_000, "0 (save none) or how many to keep, up to 1000000"))
    # a reasoning model's thinking: on / off pass enable_thinking to chat templates that read it
    # (Qwen3, Qwen3.5, Qwen3-Next); auto leaves the template's own default
    think: str = setting("auto", _choice("auto", "on", "off"))
    # the session's state written beside each saved conversation (CPU), for `chat --resume` with
    # no prefill: at most this many MiB a conversation; 0: never
    state_cache_mib: int = setting(1024, _int(0, 1 << 20, "0 (never) or a size in MiB, up to 1048576"))


SECTIONS = {"engine": EngineConfig, "sampling": SamplingConfig, "ui": UIConfig}
KEY_SECTION = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
# what `/set` and a transcript's `set` may change: the rest shapes the loaded model and session
SETTABLE = [f.name for f in dataclasses.fields(SamplingConfig)] + ["system_prompt", "markdown", "show_stats", "think",
                                                                   "speculative"]


MODEL_ORIGIN = "the model's"  # (an origin's prefix: "the model's generation_config.json")


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ui: UIConfig = field(default_factory=UIConfig)
    # key → where its value came from (a file and line, CHAT_X, --flag, /set, the model's file);
    # a key absent here has its built-in default. Not part of equality: the values are.
    origins: dict = field(default_factory=dict, compare=False)

    def with_value(self, key: str, raw, origin: str = "/set") -> "Settings":
        """One key changed (validated), e.g. from `/set temperature 0.2`."""
        if key not in KEY_SECTION:
            raise ConfigError(f"{key_text(key)}: unknown setting; known keys: {', '.join(KEY_SECTION)}")
        section = KEY_SECTION[key]
        current = dataclasses.asdict(getattr(self, section))
        current[key] = raw
        return dataclasses.replace(self, **{section: build(SECTIONS[section], current, section)},
                                   origins={**self.origins, key: origin})

    def origin(self, key: str) -> str:
        return self.origins.get(key, "default")

    def with_model_defaults(self, defaults: dict, source: str) -> tuple["Settings", list[str]]:
        """The model's own sampling defaults (generation_config.json, a GGUF's general.sampling
        keys) for each key that nothing else set (its built-in default, or a previous model's):
        they rank under config files, variables, flags and /set. Returns (settings, notes), a
        note for each value out of its key's domain (that key keeps its value)."""
        out, notes = self.without_model_defaults(), []
        for key, raw in defaults.items():
            if KEY_SECTION.get(key) != "sampling" or key in out.origins:
                continue
            try:
                out = out.with_value(key, raw, f"{MODEL_ORIGIN} {source}")
            except ConfigError as e:
                notes.append(f"the model's {source} gives {e}; not used")
        return out, notes

    def without_model_defaults(self) -> "Settings":
        """These settings with every key a model set back at its built-in default."""
        mine = [k for k, o in self.origins.items() if o.startswith(MODEL_ORIGIN)]
        if not mine:
            return self
        base = dataclasses.asdict(self.sampling)
        base.update({k: dataclasses.asdict(SamplingConfig())[k] for k in mine})
        return dataclasses.replace(self, sampling=build(SamplingConfig, base, "sampling"),
                                   origins={k: o for k, o in self.origins.items() if k not in mine})


def check_settable(values: dict) -> None:
    """Each of `values` (a transcript's `set`, its sampling header, a /set line) is a settable key
    with a value in its domain; raises ConfigError naming the first that is not."""
    if not isinstance(values, dict):
        raise ConfigError("settings must be a mapping of keys to values")
    for key, value in values.items():
        if key not in SETTABLE:
            raise ConfigError(f"'{key_text(key)}' cannot be set here (settable: {', '.join(SETTABLE)})",
                              key if isinstance(key, str) else None)
        Settings().with_value(key, value)


def default_config_path() -> str | None:
    if os.environ.get("CHAT_CONFIG"):
        return os.environ["CHAT_CONFIG"]
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    path = os.path.join(base, "chat", "config.yaml")
    return path if os.path.isfile(path) else None


# What PyYAML raises on bad input: its own errors, and plain ones from constructors (a timestamp
# like 2024-13-45, absurd nesting, undecodable bytes).
YAML_ERRORS = (yaml.YAMLError, ValueError, TypeError, RecursionError, UnicodeDecodeError)


def yaml_error_message(path: str, e: BaseException) -> str:
    """One line naming the file and, when PyYAML knows it, the line."""
    mark = getattr(e, "problem_mark", None)
    line = mark.line + 1 if mark else getattr(e, "line", None)
    where = f"{path}:{line}" if line else path
    if isinstance(e, yaml.YAMLError):
        return " ".join(f"{where}: malformed YAML: {getattr(e, 'problem', None) or e}".split())
    if isinstance(e, YamlShapeError):
        return " ".join(f"{where}: {e}".split())
    return " ".join(f"{where}: unreadable YAML: {str(e)[:200]}".split())


def read_yaml(path: str) -> dict:
    try:
        data = yaml_lines.load(read_text(path))
    except InputFileError as e:
        raise ConfigError(f"config {e}") from None
    except YAML_ERRORS as e:
        raise ConfigError(yaml_error_message(path, e)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (engine, sampling, ui)")
    return data


def load_settings(config_path: str | None = None, env: dict | None = None,
                  overrides: dict | None = None, origins: dict | None = None) -> Settings:
    """The settings from the defaults, the user file, CHAT_* variables and flags (`overrides`, keyed
    by setting; `origins` names where an override came from where it is not a flag: a recording).
    A bad value is an error naming where it came from: the file and line, the variable, or the flag."""
    env = os.environ if env is None else env
    values: dict[str, dict] = {name: {} for name in SECTIONS}
    origin: dict[str, str] = {}  # key -> where its value came from
    path = config_path or default_config_path()
    if path:
        data = read_yaml(path)
        for section, body in data.items():
            line = data.key_lines.get(section, 1) if isinstance(data, yaml_lines.LineDict) else 1
            if section not in SECTIONS:
                raise ConfigError(f"{path}:{line}: unknown section {key_text(section)}; known: {', '.join(SECTIONS)}")
            if body is None:
                continue
            if not isinstance(body, dict):
                raise ConfigError(f"{path}:{line}: section {section!r} must be a mapping of keys to values")
            for key in body:
                where = body.key_lines.get(key, line) if isinstance(body, yaml_lines.LineDict) else line
                origin[key] = f"{path}:{where}"
            values[section].update(body)
    for key, section in KEY_SECTION.items():
        var = f"CHAT_{key.upper()}"
        if var in env:
            values[section][key] = env[var]
            origin[key] = var
    for key, raw in (overrides or {}).items():
        if key not in KEY_SECTION:
            raise ConfigError(f"{key_text(key)}: unknown setting; known keys: {', '.join(KEY_SECTION)}")
        values[KEY_SECTION[key]][key] = raw
        origin[key] = (origins or {}).get(key) or f"--{key.replace('_', '-')}"
    try:
        return Settings(**{name: build(cls, values[name], name) for name, cls in SECTIONS.items()}, origins=origin)
    except ConfigError as e:
        source = origin.get(e.key) if isinstance(e.key, str) else None
        raise ConfigError(f"{source}: {e}" if source else str(e), e.key) from None
