"""YAML as config files and transcripts read it: safe_load's types only, a duplicate key refused
(YAML would keep the last one silently), and every mapping knowing its line and each key's line, so
an error can say where the bad value is.

`load(text)` returns plain Python data whose dicts are `LineDict`s (`.line`, `.key_lines`); it
raises `DuplicateKey` (a ValueError with the line) or PyYAML's own errors. Anything else malformed
(an unhashable key) is a `YamlShapeError`.
"""
from __future__ import annotations

import yaml


class LineDict(dict):
    """A mapping read from YAML: `line` is where it starts, `key_lines[key]` where each key is."""
    line = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_lines: dict = {}


class YamlShapeError(ValueError):
    """Well-formed YAML that no file of ours can hold (an unhashable key, a duplicate key)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line


class DuplicateKey(YamlShapeError):
    pass


# libyaml's parser where PyYAML has it (a long recording parses several times faster; the
# constructors below, Python's, are the same), else PyYAML's own
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    pass


def _construct_mapping(loader, node):
    # keys written in this mapping, not brought in by a merge key `<<:` (those may be overridden)
    own = {id(k) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"}
    loader.flatten_mapping(node)
    d = LineDict()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            raise YamlShapeError(line, "a mapping key must be a plain value") from None
        if key in d and id(key_node) in own and d.key_lines.get(key, (0, False))[1]:
            raise DuplicateKey(line, f"duplicate key {str(key)[:40]!r} (first at line "
                                     f"{d.key_lines[key][0]}); keep one")
        d[key] = loader.construct_object(value_node, deep=True)
        d.key_lines[key] = (line, id(key_node) in own)
    d.key_lines = {k: line for k, (line, _) in d.key_lines.items()}
    d.line = node.start_mark.line + 1
    return d


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(text):
    """Parse one YAML document (str or a text stream) as safe_load would, with the checks above."""
    return yaml.load(text, Loader=_Loader)  # a (C)SafeLoader subclass: no arbitrary objects
