"""Settings: config.yaml sections → validated dataclasses, with env and flag overrides.

Precedence, lowest first: the defaults (identical to the repo's config.yaml, a test checks), a user
file (--config PATH, $CHAT_CONFIG, or $XDG_CONFIG_HOME/chat/config.yaml), CHAT_<KEY> environment
variables, then --<key> flags. Keys are unique across sections, so each maps one to one to a flag
and a variable. YAML is read with safe_load; errors name the file, line, key and allowed values.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import yaml

from engine.config import (ConfigError, EngineConfig, SamplingConfig, _Validated, _bool, _choice, _int, _str, build,
                           setting)


@dataclass(frozen=True)
class UIConfig(_Validated):
    system_prompt: str = setting("", _str())
    markdown: bool = setting(True, _bool())
    show_stats: bool = setting(True, _bool())
    color: str = setting("auto", _choice("auto", "always", "never"))
    history_file: str = setting("", _str())
    conversations_dir: str = setting("", _str())
    keep_conversations: int = setting(100, _int(0, allowed="0 (save none) or how many to keep"))


SECTIONS = {"engine": EngineConfig, "sampling": SamplingConfig, "ui": UIConfig}
KEY_SECTION = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ui: UIConfig = field(default_factory=UIConfig)

    def with_value(self, key: str, raw) -> "Settings":
        """One key changed (validated), e.g. from `/set temperature 0.2`."""
        if key not in KEY_SECTION:
            raise ConfigError(f"{key}: unknown setting; known keys: {', '.join(KEY_SECTION)}")
        section = KEY_SECTION[key]
        current = dataclasses.asdict(getattr(self, section))
        current[key] = raw
        return dataclasses.replace(self, **{section: build(SECTIONS[section], current, section)})


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
    where = f"{path}:{mark.line + 1}" if mark else path
    if isinstance(e, yaml.YAMLError):
        return " ".join(f"{where}: malformed YAML: {getattr(e, 'problem', None) or e}".split())
    return " ".join(f"{where}: unreadable YAML: {e}".split())


def read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    except YAML_ERRORS as e:
        raise ConfigError(yaml_error_message(path, e)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (engine, sampling, ui)")
    return data


def load_settings(config_path: str | None = None, env: dict | None = None,
                  overrides: dict | None = None) -> Settings:
    env = os.environ if env is None else env
    values: dict[str, dict] = {name: {} for name in SECTIONS}
    path = config_path or default_config_path()
    if path:
        for section, body in read_yaml(path).items():
            if section not in SECTIONS:
                raise ConfigError(f"{path}: unknown section {section!r}; known: {', '.join(SECTIONS)}")
            if body is None:
                continue
            if not isinstance(body, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping of keys to values")
            values[section].update(body)
    for key, section in KEY_SECTION.items():
        var = f"CHAT_{key.upper()}"
        if var in env:
            values[section][key] = env[var]
    for key, raw in (overrides or {}).items():
        if key not in KEY_SECTION:
            raise ConfigError(f"{key}: unknown setting; known keys: {', '.join(KEY_SECTION)}")
        values[KEY_SECTION[key]][key] = raw
    try:
        return Settings(**{name: build(cls, values[name], name) for name, cls in SECTIONS.items()})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
