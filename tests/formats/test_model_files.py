"""Bad model files: one line on stderr starting `chat: error:`, exit code 2, never a traceback, never
a hang. Configs are decoded and type-checked before use and their sizes checked against the
tensors before anything is allocated; only regular files and directories are models; a GGUF file
cut short or garbled names where it ends and what its header implies."""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import pytest

import models
from models.formats import checkpoints
from models.formats.checkpoints import CheckpointError


def run_chat(*args, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))  # no GGUF index of these files is kept
    return subprocess.run([sys.executable, "-m", "chat", *args, "--prompt", "hi"], capture_output=True, text=True,
                          timeout=60, env=env, stdin=subprocess.DEVNULL)  # a hang fails the test


def assert_clean_error(proc, *needles):
    code, err = proc.returncode, proc.stderr  # (a failure report then leaves out a model's random reply)
    assert code == 2, (code, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chat: error:"), err
    for n in needles:
        assert n in lines[0], lines[0]


class Hung(BaseException):
    """Raised by the alarm in load_error (no `except Exception` or `except OSError` swallows it)."""


def load_error(path, seconds: int = 30) -> str:
    """The one-line CheckpointError that loading `path` raises; a load still running after
    `seconds` fails the test."""
    def hang(*_):
        raise Hung(f"loading {path} ran {seconds} s")
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        with pytest.raises(CheckpointError) as e:
            models.load(str(path))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    return message


@pytest.fixture
def model_dir(tiny_dirs, tmp_path):
    return shutil.copytree(tiny_dirs["llama"][0], tmp_path / "m")


def edit_config(d, **values):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(values)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def gguf_bytes(tiny_dirs, tmp_path_factory) -> bytes:
    from gguf import GGMLQuantizationType as Q
    from tests.support.tiny_gguf import write_gguf
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return open(write_gguf("llama", path, tiny_dirs["llama"][1], Q.Q8_0), "rb").read()


def gguf_error(data: bytes, tmp_path, monkeypatch) -> str:
    monkeypatch.setattr(checkpoints, "INDEX_DIR", str(tmp_path / "cache"))
    f = tmp_path / "bad.gguf"
    f.write_bytes(data)
    return load_error(f)


def after_key(data: bytes, key: str) -> int:
    """The offset just past metadata key `key`'s name: its value type (u32) is there."""
    at = data.index(key.encode())
    assert struct.unpack_from("<Q", data, at - 8)[0] == len(key)
    return at + len(key)


# --- config.json ------------------------------------------------------------------------------

@pytest.mark.slow
def test_config_that_is_not_an_object(model_dir, tmp_path):
    (model_dir / "config.json").write_text("[]")
    assert_clean_error(run_chat("--model", str(model_dir), tmp_path=tmp_path), "config.json",
                       "expected a JSON object", "found a list")


@pytest.mark.slow
def test_config_that_is_not_utf8(model_dir, tmp_path):
    (model_dir / "config.json").write_bytes(b'{"model_type": "ll\xe9ama"}')
    assert_clean_error(run_chat("--model", str(model_dir), tmp_path=tmp_path), "config.json", "not UTF-8",
                       "0xe9 at offset 18")


@pytest.mark.slow
def test_null_text_config(model_dir, tmp_path):
    edit_config(model_dir, text_config=None)
    assert_clean_error(run_chat("--model", str(model_dir), tmp_path=tmp_path), "config.json",
                       "text_config must be an object", "not null")


@pytest.mark.parametrize("values, needle", [
    ({"hidden_size": "64"}, 'hidden_size must be an integer from 1 to 16777215, not "64"'),
    ({"hidden_size": 64.0}, "hidden_size must be an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    ({"vocab_size": 10 ** 12}, "vocab_size must be an integer from 1 to 16777215, not 1000000000000"),
    ({"intermediate_size": -5}, "intermediate_size must be an integer from 0"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer from 1"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ({"rope_parameters": []}, "rope_parameters must be an object"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps must be a finite number"),
    ({"model_type": ["llama"]}, "model_type must be a string"),
    ({"quantization_config": "fp8"}, "quantization_config must be an object"),
    ({"text_config": {"hidden_size": [64]}}, "text_config.hidden_size must be an integer"),
    ({"hidden_size": "x" * 10000}, 'not "xxxxxxxx'),  # quoted, not whole
])
def test_config_values_are_checked_before_use(model_dir, values, needle):
    edit_config(model_dir, **values)
    message = load_error(model_dir)
    assert message.startswith(str(model_dir / "config.json")) and needle in message, message
    assert models.native_dtype(str(model_dir)) == (None, "")  # the loader, not the dtype guess, reports it


@pytest.mark.parametrize("text, needle", [
    ('{"hidden_size": 64,', "invalid JSON at line 1"),
    ("1" * 5000, "invalid JSON"),  # past Python's digit limit: a ValueError, not a JSONDecodeError
    ("[" * 100000 + "]" * 100000, "invalid JSON"),  # deeper than the parser's recursion
])
def test_undecodable_config(model_dir, text, needle):
    (model_dir / "config.json").write_text(text)
    assert needle in load_error(model_dir)


def test_sizes_are_checked_against_the_tensors_before_allocating(model_dir):
    """A size in range that the tensors contradict: the model is built on the meta device and its
    shapes compared with the checkpoint's; the message names the tensor and both shapes."""
    edit_config(model_dir, hidden_size=1 << 20, head_dim=16)  # 320 x 2**20 fp32 would be 1.3 GB
    message = load_error(model_dir)
    assert message.startswith(str(model_dir)), message
    assert "(320, 64) in the checkpoint, but the config makes it (320, 1048576)" in message, message


@pytest.mark.slow
def test_more_layers_than_the_checkpoint_holds(model_dir, tmp_path):
    """Building millions of layers, even on the meta device, would not end: refused from the names."""
    edit_config(model_dir, num_hidden_layers=(1 << 24) - 1)
    assert_clean_error(run_chat("--model", str(model_dir), tmp_path=tmp_path), str(model_dir),
                       "the config asks for 16777215 layers, the checkpoint's tensors hold 2")


@pytest.mark.parametrize("file, value, needle", [
    ("generation_config.json", {"eos_token_id": "2"}, "eos_token_id must be a token id"),
    ("tokenizer_config.json", {"chat_template": 7}, "chat_template must be a string"),
    ("tokenizer_config.json", {"eos_token": ["<|im_end|>"]}, "eos_token must be a string"),
    ("model.safetensors.index.json", {"weight_map": ["model.safetensors"]}, "weight_map must be an object"),
])
def test_other_json_files_are_checked(model_dir, file, value, needle):
    (model_dir / file).write_text(json.dumps(value))
    message = load_error(model_dir)
    assert message.startswith(str(model_dir / file)) and needle in message, message


# --- what a model path is -----------------------------------------------------------------------

@pytest.mark.slow
def test_fifo_as_model(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert_clean_error(run_chat("--model", str(fifo), tmp_path=tmp_path), str(fifo), "a FIFO (named pipe)",
                       "not a model file or directory")


@pytest.mark.slow
def test_character_device_as_model(tmp_path):
    assert_clean_error(run_chat("--model", "/dev/null", tmp_path=tmp_path), "/dev/null", "a character device")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors", "generation_config.json",
                                  "chat_template.jinja"])
def test_fifo_inside_a_model_directory(model_dir, tmp_path, name):
    (model_dir / name).unlink(missing_ok=True)
    os.mkfifo(model_dir / name)
    assert_clean_error(run_chat("--model", str(model_dir), tmp_path=tmp_path), str(model_dir / name),
                       "a FIFO (named pipe), not a regular file")


def test_directory_where_a_file_belongs(model_dir):
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer.json").mkdir()
    assert "tokenizer.json: a directory, not a regular file" in load_error(model_dir)


@pytest.mark.slow
def test_symlink_loop_as_model(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert_clean_error(run_chat("--model", str(loop), tmp_path=tmp_path), str(loop), "a symbolic link loop")


def test_broken_symlink_as_model_and_inside_a_directory(model_dir, tmp_path):
    link = tmp_path / "gone.gguf"
    link.symlink_to(tmp_path / "nowhere.gguf")
    with pytest.raises(CheckpointError, match="a broken symbolic link"):
        models.resolve(str(link))
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer.json").symlink_to(tmp_path / "nowhere.json")
    assert "tokenizer.json: a broken symbolic link" in load_error(model_dir)


# --- GGUF files ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_truncated_gguf_names_the_byte_and_the_size(gguf_bytes, tmp_path):
    cut = len(gguf_bytes) // 2
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(gguf_bytes[:cut])
    assert_clean_error(run_chat("--model", str(bad), tmp_path=tmp_path), str(bad),
                       f"truncated at byte {cut} of {len(gguf_bytes)}", "runs past the end")


@pytest.mark.parametrize("where", [0, 4, 23, 30, 300, ("tokenizer.ggml.tokens", 2000),
                                   ("tokenizer.chat_template", 100), ("blk.1.attn_q.weight", 10)])
def test_truncated_gguf_header(gguf_bytes, tmp_path, monkeypatch, where):
    """Cut in the counts, in the vocabulary's strings, in a string value, in the tensors' info."""
    cut = where if isinstance(where, int) else gguf_bytes.index(where[0].encode()) + where[1]
    message = gguf_error(gguf_bytes[:cut], tmp_path, monkeypatch)
    assert f"truncated at byte {cut} of at least " in message or (cut < 4 and "not a GGUF" in message), message


def patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_garbled_gguf_array_count(gguf_bytes, tmp_path, monkeypatch):
    """gguf's reader reads a numeric array element by element, on past the end of the file, where
    each read is empty: with whole elements to the end, a count of 2**40 never ended."""
    at = after_key(gguf_bytes, "tokenizer.ggml.token_type") + 8  # past the value type and the item type
    data = patched(gguf_bytes, at, "<Q", 1 << 40)
    data += bytes(-(len(data) - at - 8) % 4)  # int32 elements up to the end
    message = gguf_error(data, tmp_path, monkeypatch)
    assert "key 'tokenizer.ggml.token_type'" in message and "runs past the end" in message, message
    at = after_key(gguf_bytes, "tokenizer.ggml.tokens") + 8  # an array of strings
    message = gguf_error(patched(gguf_bytes, at, "<Q", 1 << 62), tmp_path, monkeypatch)
    assert "damaged GGUF header: key 'tokenizer.ggml.tokens'" in message, message


def test_garbled_gguf_header(gguf_bytes, tmp_path, monkeypatch):
    at = after_key(gguf_bytes, "general.architecture")
    message = gguf_error(patched(gguf_bytes, at, "<I", 77), tmp_path, monkeypatch)
    assert "key 'general.architecture' has the unknown value type 77" in message, message
    message = gguf_error(patched(gguf_bytes, 16, "<Q", 1 << 60), tmp_path, monkeypatch)  # the key count
    assert "damaged GGUF header" in message, message
    message = gguf_error(patched(gguf_bytes, 4, "<I", 9), tmp_path, monkeypatch)
    assert "GGUF version 9 is not supported" in message, message
    at = gguf_bytes.index(b"token_embd.weight") + len(b"token_embd.weight")
    message = gguf_error(patched(gguf_bytes, at, "<I", 9), tmp_path, monkeypatch)  # its dimension count
    assert "tensor 'token_embd.weight' has 9 dims" in message, message
    at += 4 + 2 * 8  # its GGML type, after two dimensions
    message = gguf_error(patched(gguf_bytes, at, "<I", 1000), tmp_path, monkeypatch)
    assert "unknown GGML type 1000" in message, message


@pytest.mark.parametrize("key, fmt, value, needle", [
    ("llama.embedding_length", "<I", 1 << 30, "llama.embedding_length must be an integer from 1"),
    ("llama.block_count", "<I", 0, "llama.block_count must be an integer from 1"),
])
def test_gguf_metadata_values_are_checked(gguf_bytes, tmp_path, monkeypatch, key, fmt, value, needle):
    at = after_key(gguf_bytes, key) + 4  # past its value type
    message = gguf_error(patched(gguf_bytes, at, fmt, value), tmp_path, monkeypatch)
    assert needle in message, message


def test_gguf_special_token_past_the_vocabulary(gguf_bytes, tmp_path, monkeypatch):
    """As llama.cpp does: no special token (it was an IndexError)."""
    monkeypatch.setattr(checkpoints, "INDEX_DIR", str(tmp_path / "cache"))
    f = tmp_path / "eos.gguf"
    f.write_bytes(patched(gguf_bytes, after_key(gguf_bytes, "tokenizer.ggml.eos_token_id") + 4, "<I", 1 << 30))
    loaded = models.load(str(f))
    assert loaded.eos_token is None and (1 << 30) not in loaded.eos_ids


def test_gguf_with_more_blocks_than_tensors(gguf_bytes, tmp_path, monkeypatch):
    at = after_key(gguf_bytes, "llama.block_count") + 4
    message = gguf_error(patched(gguf_bytes, at, "<I", (1 << 24) - 1), tmp_path, monkeypatch)
    assert "llama.block_count is 16777215, the file's tensors hold 2 blocks" in message, message


def test_check_gguf_layout_accepts_the_embedded_model(smollm2_path):
    checkpoints.check_gguf_layout(smollm2_path)
