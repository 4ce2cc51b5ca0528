"""`think: on | off` (--think, /think, a script's /think): enable_thinking passed to a chat
template that reads it, rendering as transformers' apply_chat_template renders it; a template that
does not read it gets a notice; /show states it; a recording made with it replays."""
from __future__ import annotations

import json
import os

import pytest
from tests.support.cli import run_chat as chat
from tests.support.paths import ROOT

TEMPLATE = open(os.path.join(ROOT, "tests", "data", "thinking_template.jinja"), encoding="utf-8").read()
# Qwen3.5's own template (Qwen3.5-4B's, as llama.cpp's tree keeps it: models/templates/Qwen3.5-4B.jinja)
QWEN3_5 = open(os.path.join(ROOT, "tests", "data", "qwen3_5_template.jinja"), encoding="utf-8").read()
TINY = os.path.join(ROOT, "tests", "golden", "tiny-llama")  # (ChatML: no enable_thinking)
MESSAGES = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>\n\n4"},
            {"role": "user", "content": "and 3+3?"}]


def tiny_with(template: str, path: str) -> str:
    """A tiny Qwen3.5 checkpoint whose tokenizer_config.json carries `template`."""
    from tests.support.tiny import write_checkpoint
    path = write_checkpoint("qwen3_5", path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = template
    json.dump(cfg, open(cfg_path, "w"))
    return path


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return tiny_with(TEMPLATE, str(tmp_path_factory.mktemp("think")))


@pytest.fixture(scope="module")
def qwen3_5_model(tmp_path_factory):
    return tiny_with(QWEN3_5, str(tmp_path_factory.mktemp("qwen3_5")))


@pytest.mark.parametrize("which", ["thinking_model", "qwen3_5_model"])
@pytest.mark.parametrize("think", ["auto", "on", "off"])
def test_rendered_as_transformers_renders_it(request, which, think):
    from transformers import AutoTokenizer

    from chat.conversation import Conversation
    from chat.template import ChatTemplate
    model = request.getfixturevalue(which)
    template = QWEN3_5 if which == "qwen3_5_model" else TEMPLATE
    hf = AutoTokenizer.from_pretrained(model)
    extra = {} if think == "auto" else {"enable_thinking": think == "on"}
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **extra)
    conv = Conversation(ChatTemplate(template), None, think=think)
    assert conv.template.render(MESSAGES, add_generation_prompt=True, **conv.render_args()) == want
    assert want.endswith("<think>\n\n</think>\n\n") == (think == "off")


@pytest.mark.parametrize("which", ["thinking_model", "qwen3_5_model"])
def test_the_prompt_ids_of_a_turn(request, which):
    from transformers import AutoTokenizer
    thinking_model = request.getfixturevalue(which)

    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from chat.turn import TurnResult
    rt = open_runtime(load_settings(env={}, overrides={"model": thinking_model, "think": "off", "temperature": 0,
                                                       "max_new_tokens": 2}))
    c = ChatController(rt, rt.settings)
    result = TurnResult([])
    list(c.send("hi", result))
    hf = AutoTokenizer.from_pretrained(thinking_model)
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert result.prompt_ids == hf(text, add_special_tokens=False)["input_ids"]
    assert c.turns[-1].think == "off"


@pytest.mark.slow
def test_the_repl_states_it_and_notes_a_template_without_it(thinking_model, tmp_path):
    p = chat("--model", thinking_model, "--max-new-tokens", "2", stdin="/think off\n/show\n/think\n/exit\n",
             tmp_path=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout.count("thinking: off (enable_thinking=false)") == 3, p.stdout
    p = chat("--model", TINY, "--think", "off", "--max-new-tokens", "2", stdin="/think on\n/exit\n", tmp_path=tmp_path)
    assert p.returncode == 0 and p.stderr.count("does not read enable_thinking") == 2, p.stderr
    p = chat("--model", TINY, "--think", "off", "--prompt", "hi", "--max-new-tokens", "2", tmp_path=tmp_path)
    assert p.returncode == 0 and "chat: note: think: off changes nothing here" in p.stderr, p.stderr


@pytest.mark.slow
def test_a_script_switches_it_and_its_recording_replays(thinking_model, tmp_path):
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0, max_new_tokens: 3}\n"
                      "events:\n- user: hi\n- command: /think off\n- user: again\n")
    rec = tmp_path / "r.yaml"
    p = chat("run", script, "--model", thinking_model, "-o", rec, tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    import yaml
    events = yaml.safe_load(rec.read_text())["events"]
    assert events[1]["command"] == "/think off"
    p = chat("replay", rec, "--runs", "1", tmp_path=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_a_repl_recording_states_the_switch_and_replays(thinking_model, tmp_path):
    saved = tmp_path / "saved.yaml"
    p = chat("--model", thinking_model, "--temperature", "0", "--max-new-tokens", "3",
             stdin=f"hi\n/think off\nagain\n/save {saved}\n/exit\n", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    import yaml
    events = yaml.safe_load(saved.read_text())["events"]
    assert "set" not in events[0] and events[1]["set"] == {"think": "off"}
    assert chat("replay", saved, "--runs", "1", tmp_path=tmp_path).returncode == 0
    # (and without the switch the second prompt differs: the replay would diverge)
    events[1].pop("set")
    doc = yaml.safe_load(saved.read_text())
    doc["events"] = events
    saved.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert chat("replay", saved, "--runs", "1", tmp_path=tmp_path).returncode == 1
