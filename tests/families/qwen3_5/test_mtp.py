"""The Qwen3.5 multi-token-prediction layer (models/architectures/mtp.py) and its drafts
(engine/speculative.py MtpDrafts, `speculative: mtp | auto`).

The layer against llama.cpp's own draft-mtp on the same GGUF (its logits on every prompt row and
its chained drafts; tests/support/llama_mtp.py, run where a Python with llama-cpp-python 0.3.36 is named
by CHAT_LLAMA_PYTHON), the GGUF that llama.cpp's converter writes (the nextn block) against the
HF directory it came from, and replies with MTP drafts against plain decoding token for token,
greedy and sampled, in blocks and fp32, through rejections, rewinds and a state loaded from
elsewhere; the layer's cache kept across verifies against one computed afresh.
"""
import json
import os
import random
import subprocess

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from engine.config import ConfigError, SamplingConfig
from engine.session import DecodeSession
from engine.speculative import MtpDrafts, PromptLookup
from tests.support.paths import SUPPORT
from tests.support.speculative import Always, kv_live

GREEDY = SamplingConfig(temperature=0, max_new_tokens=40)
SAMPLED = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, min_p=0.0, seed=5, max_new_tokens=40)
PROMPT = [5, 9, 17, 33, 40, 41, 42, 5, 9, 17]


def with_mtp(path: str, kind: str = "qwen3_5") -> str:
    """A tiny Qwen3.5 (Qwen3.5-MoE, Qwen3-Next) checkpoint with an MTP layer; Qwen3.5's M-RoPE
    sections that fit its 4 rotary dims (for llama.cpp's RoPE; text positions make every section
    the same rotation); Qwen3-Next's every layer MoE (as its converter requires)."""
    from tests.support.tiny import add_mtp, write_checkpoint
    write_checkpoint(kind, path, seed=3, **({"mlp_only_layers": []} if kind == "qwen3_next" else {}))
    add_mtp(path)
    if kind == "qwen3_next":
        return path
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["rope_parameters"]["mrope_section"] = [1, 1, 0]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.support.llama_cpp_tree import convert
    d = tmp_path_factory.mktemp("mtp")
    hf = with_mtp(str(d / "hf"))
    return hf, convert(hf, str(d / "mtp.gguf"), "f32", pre="qwen2")


def in_blocks(lm, qtype):
    """lm with every linear of its layers and its MTP layer in GGUF blocks of qtype."""
    from gguf import quants
    from models.quant import layers as quant
    for root in (lm.model.model.layers, lm.model.mtp):
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and child.weight.shape[1] % 32 == 0:
                    raw = quants.quantize(child.weight.detach().numpy(), qtype)
                    setattr(parent, name, quant.BlockLinear(torch.from_numpy(raw), int(qtype),
                                                            getattr(child, "sizes", None)))
    return lm


def session(lm, mode="mtp", max_context=128):
    return DecodeSession(lm.model, max_context=max_context, device=torch.device("cpu"), dtype=torch.float32,
                         cpu_kernel="on", speculative=mode)


def reply(s, cfg, prompt=PROMPT):
    return list(s.generate(prompt, cfg)), list(s.cached), s.state.length, kv_live(s)


def same(a, b):
    assert a[:3] == b[:3]
    assert all(torch.equal(x, y) for x, y in zip(a[3], b[3]))


def mtp_rows(lm, prompt):
    """Our model's final-normed rows of the prompt, the MTP logits of each prompt row (token p with
    the row of p - 1), the next token and the 3 drafts after it."""
    s = session(lm)
    last = s.prefill(prompt)
    m = s._mtp
    out = m._run(prompt, m._hidden(0, len(prompt)), 0)
    m.ids = []
    nxt = int(last[-1].argmax())
    return m.rows[:len(prompt)].clone(), m.head.logits(lm.model, out), nxt, m.propose(prompt, nxt, 3)


@pytest.mark.slow
def test_the_gguf_holds_the_hf_directorys_mtp_layer(files):
    """llama.cpp's converter writes the MTP layer as the nextn block (its norms stored as 1 + w):
    the GGUF's layer is the HF directory's, weight for weight, and drafts the same tokens."""
    hf, path = files
    a, b = models.load(hf), models.load(path)
    assert a.model.mtp is not None and b.model.mtp is not None
    sa, sb = a.model.mtp.state_dict(), b.model.mtp.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-6, msg=k)
    ra, rb = mtp_rows(a, PROMPT), mtp_rows(b, PROMPT)
    torch.testing.assert_close(ra[1], rb[1], rtol=0, atol=1e-4)
    assert ra[2:] == rb[2:]


@pytest.mark.slow
def test_the_drafts_are_llama_cpps(files):
    """llama.cpp 0.3.36's draft-mtp on the same GGUF (tests/support/llama_mtp.py): the MTP logits of every
    prompt row agree to fp32 rounding and the chained drafts are the same tokens."""
    drafts_against_llama_cpp(files[1], "dense")


@pytest.mark.slow
def test_the_moe_drafts_are_llama_cpps(moe_files):
    """The same for the MoE hybrids (Qwen3.5-MoE, Qwen3-Next): their file is Q8_0 (the experts stay
    blocks only so), read on int8 inputs as llama.cpp reads it."""
    drafts_against_llama_cpp(moe_files[2], "moe")


def drafts_against_llama_cpp(path: str, kind: str) -> None:
    python = os.environ.get("CHAT_LLAMA_PYTHON")
    if not python:
        pytest.skip("CHAT_LLAMA_PYTHON names no Python with llama-cpp-python 0.3.36 (a reference only)")
    p = subprocess.run([python, os.path.join(SUPPORT, "llama_mtp.py"), path, json.dumps({"prompt": PROMPT, "draft": 3})],
                       capture_output=True, text=True, cwd="/", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    ref = json.loads(p.stdout.strip().splitlines()[-1])
    lm = models.load(path, quantized=kind == "moe")
    models.use_int8_inputs(lm.model, kind == "moe")
    hidden, logits, nxt, drafts = mtp_rows(lm, PROMPT)
    # (Q8_0: the two sides' roundings of activations, KV and norms apart move the rows by ~1e-2)
    tol = 2e-3 if kind == "dense" else 3e-2
    torch.testing.assert_close(hidden, torch.tensor(ref["hidden"]), rtol=0, atol=tol)
    ref_logits = torch.tensor(ref["mtp_logits"])
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=tol / 2 * ref_logits.abs().max().item())
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    assert (nxt, drafts) == (ref["next"], ref["drafts"])


@pytest.fixture(scope="module", params=[None, Q.Q8_0], ids=["fp32", "Q8_0"])
def lm(request, files):
    lm = models.load(files[0])
    return lm if request.param is None else in_blocks(lm, request.param)


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafts", ["layer", "right", "random"])
def test_replies_equal_plain_decoding(lm, cfg, drafts):
    """MTP drafts (the layer's own; or, to reach long accepted runs, the layer run and its tokens
    replaced by the plain reply's, all or at random): the same tokens, cached ids, length and KV
    as plain decoding, at depths 1 to 5."""
    plain = reply(session(lm, "off"), cfg)
    rng = random.Random(3)
    for depth in (1, 2, 5):
        s = session(lm)
        s._depth = Always(depth)
        if drafts != "layer":
            propose = s._mtp.propose

            def replaced(context, token, k, propose=propose):
                got = propose(context, token, k)  # (the layer runs: its cache goes through the verifies)
                at = len(context) + 1 - len(PROMPT)
                right = plain[0][at:at + len(got)]
                return [t if drafts == "right" or rng.random() < 0.6 else (t + 1) % 320 for t in right]
            s._mtp.propose = replaced
        got = reply(s, cfg)
        same(got, plain)
        assert s.last_stats.drafted > 0
        if drafts == "right":
            assert s.last_stats.accepted > s.last_stats.drafted // 2


def test_the_layers_cache_equals_one_computed_afresh(lm):
    """After replies with verifies, rejected drafts, a rollback and a second turn, the layer's
    cache holds, at every position of the context, the keys and values of a layer that computes
    every row afresh (the rows of rejected drafts recomputed), and drafts the same tokens."""
    s = session(lm)
    s._depth = Always(3)
    list(s.generate(PROMPT, GREEDY))
    s.rollback_to(len(PROMPT) + 7)
    list(s.generate(s.cached + [44, 45, 46], SamplingConfig(temperature=0.8, seed=2, max_new_tokens=20)))
    context, token = s.cached[:-1], s.cached[-1]
    kept = s._mtp.propose(context, token, 4)
    fresh = MtpDrafts(lm.model, s.max_context, s.device, s.state.kv_dtype)
    fresh.rows, fresh.rows_from = s._mtp.rows, 0
    assert fresh.propose(context, token, 4) == kept
    n = len(context) + 1  # the positions whose rows both hold: the context's and the token's
    # (the two computed their rows in other groupings, through other kernels of the blocks: fp32
    # sums in another order, which a 16-bit cache may round one step apart; an fp32 cache keeps
    # them within 1e-5)
    rtol = 0.0 if s._mtp.cache.k.dtype == torch.float32 else torch.finfo(s._mtp.cache.k.dtype).eps
    for a, b in ((s._mtp.cache.k, fresh.cache.k), (s._mtp.cache.v, fresh.cache.v)):
        torch.testing.assert_close(a[:, :n], b[:, :n], rtol=rtol, atol=1e-5)


def test_a_loaded_state_drafts_without_its_rows(lm, tmp_path):
    """A state that came from a file (no rows of the model's were seen for it): drafts start from
    zeros there, as llama.cpp's do at a sequence's start, and the reply is plain decoding's."""
    a = session(lm, "off")
    a.prefill(PROMPT)
    ids, tensors = a.export_state()
    plain = list(a.generate(PROMPT + [50, 51], GREEDY))
    b = session(lm)
    b._depth = Always(2)
    b.load_state(ids, tensors)
    assert b._mtp.rows_from == len(PROMPT)
    assert list(b.generate(PROMPT + [50, 51], GREEDY)) == plain
    assert b.last_stats.drafted > 0


def test_stripped_weights_load_without_the_layer(tmp_path):
    """A checkpoint whose config names an MTP layer but whose mtp.* weights were stripped (as many
    uploads strip them) loads without one; `speculative: mtp` then says why in one line."""
    from tests.support.tiny import write_checkpoint
    d = write_checkpoint("qwen3_5", str(tmp_path / "hf"))
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c["mtp_num_hidden_layers"] = 1
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    lm = models.load(d)
    assert lm.model.mtp is None
    with pytest.raises(ConfigError, match="speculative: mtp needs a model with a multi-token-prediction layer"):
        session(lm)
    assert "MTP" not in session(lm, "auto").speculation_text


def test_show_names_the_source(lm):
    """mtp: lookup where the context repeats, the layer elsewhere; auto leaves the layer out (the
    CPU's verify: a draft's pass over the LM head costs more than its tokens save)."""
    assert session(lm).speculation_text.startswith("mtp: prompt-lookup drafts, else the MTP layer's")
    for mode in ("auto", "lookup"):
        s = session(lm, mode)
        assert s.speculation_text.startswith(f"{mode}: prompt-lookup drafts,") and s._mtp is None


def test_rows_fed_while_off_are_not_read(lm):
    """Switched off, the session hands the layer no rows: switched on again, those positions count
    as unknown (zeros), not as the stale rows of whatever was fed there before."""
    s = session(lm)
    s.prefill(PROMPT)
    assert s._mtp.rows_from == 0
    s.set_speculative("off")
    s.prefill([60, 61])
    s.set_speculative("mtp")
    assert s._mtp.rows_from == len(PROMPT) + 2


def test_the_plan_counts_no_mtp_reads_in_a_step(files):
    """The MTP layer is planned (its linears bound like the model's) but a decode step reads none
    of it: the plan's step bytes and KV bytes a token are those of the model without it."""
    from models import plan
    with_layer = models.load(files[0]).model
    without = models.load(files[0]).model
    without.mtp = None
    for device in ("cpu", "cuda"):
        a, b = plan.make(with_layer, device, torch.float32), plan.make(without, device, torch.float32)
        assert len(a.choices) > len(b.choices)
        assert (a.decode_bytes(), a.kv_bytes_per_token()) == (b.decode_bytes(), b.kv_bytes_per_token())


def test_the_layer_is_loaded_only_where_its_drafts_run(files):
    """Only the CPU has an exact verify: a CUDA load leaves the layer out (its memory saved), and so
    does a tensor-parallel rank's model, whose config never says it has one."""
    from models import loader
    from models.formats.checkpoints import load_hf_dir
    ckpt = load_hf_dir(files[0], lazy=True)
    for device, held in (("cpu", 1), ("cuda", 0)):
        cfg = dict(ckpt.config)
        loader.count_mtp_layers(cfg, ckpt.tensors, torch.device(device))
        assert cfg[loader.MTP_LOADED] == held
    full, _, _ = loader.sharding_plan(files[0], 2, dict(ckpt.config))
    assert full.mtp is None


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def moe_files(request, tmp_path_factory):
    """A tiny Qwen3.5-MoE (or Qwen3-Next) checkpoint with an MTP layer (its MLP routed experts) and
    llama.cpp's conversions of it: f32, and Q8_0 (the nextn block's experts in blocks)."""
    from tests.support.llama_cpp_tree import convert
    d = tmp_path_factory.mktemp("mtp-moe")
    hf = with_mtp(str(d / "hf"), request.param)
    return hf, convert(hf, str(d / "f32.gguf"), "f32", pre="qwen2"), convert(hf, str(d / "q8.gguf"), "q8_0", pre="qwen2")


@pytest.mark.slow
def test_a_moe_hybrid_keeps_its_layer_where_its_experts_stay_blocks(moe_files):
    """Qwen3.5-MoE's MTP layer holds a layer's experts, and the exact verify its drafts need is the
    C++ step's, which reads experts as GGUF blocks: a GGUF loaded with its blocks keeps the layer
    (its experts the file's blocks); the HF directory and a dequantized load leave it out, and
    `mtp` says why."""
    from models.quant import layers as quant
    hf, _, q8 = moe_files
    for lm in (models.load(hf), models.load(q8)):
        assert lm.model.mtp is None
        with pytest.raises(ConfigError, match="speculative: mtp is unavailable here"):
            DecodeSession(lm.model, max_context=128, device=torch.device("cpu"), dtype=torch.float32,
                          speculative="mtp")
    lm = models.load(q8, quantized=True)
    assert isinstance(lm.model.mtp.layers[0].mlp.experts, quant.BlockExperts)
    assert session(lm).speculation_text.startswith("mtp:")


@pytest.mark.slow
def test_a_moe_gguf_holds_the_hf_directorys_mtp_layer(moe_files, monkeypatch):
    """The nextn block of a MoE hybrid (its routed experts, shared expert and gate among the
    layer's tensors) maps to the HF directory's MTP layer, weight for weight (both loads made to
    keep the layer: their experts are dense here)."""
    from models import loader
    hf, f32, _ = moe_files
    count = loader.count_mtp_layers

    def keep(config, tensors, device):  # (as if the experts stayed blocks)
        count(config, tensors, device)
        cfg = config.get("text_config", config)
        cfg[loader.MTP_LOADED] = 1
    monkeypatch.setattr(loader, "count_mtp_layers", keep)
    a, b = models.load(hf), models.load(f32)
    sa, sb = a.model.mtp.state_dict(), b.model.mtp.state_dict()
    assert sa.keys() == sb.keys() and any("experts" in k for k in sa)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("int8", [False, True], ids=["fp32-inputs", "int8-inputs"])
@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_moe_replies_with_its_drafts_equal_plain_decoding(moe_files, cfg, int8):
    """A Qwen3.5-MoE Q8_0 GGUF on the C++ step, drafting from its MTP layer at depths 1 to 5: the
    same tokens, cached ids, length and KV as plain decoding."""
    lm = models.load(moe_files[2], quantized=True)
    models.use_int8_inputs(lm.model, int8)
    plain = reply(session(lm, "off"), cfg)
    for depth in (1, 2, 5):
        s = session(lm)
        s._depth = Always(depth)
        same(reply(s, cfg), plain)
        assert s.last_stats.drafted > 0


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_property_mtp_generations_equal_a_cold_session(files, temperature):
    """The checkpoint property test with `speculative: mtp`: Hypothesis's sends, /undo, /retry and
    resets on one conversation, every reply a cold session's without drafts."""
    from tests.support.checkpoints import check_property, controller
    c = controller(files[0], temperature=temperature, seed="3", speculative="mtp")
    assert c.session.speculation_text.startswith("mtp:")
    check_property(c, 10)
    assert c.session._mtp.ids  # (the layer drafted)


def test_replies_with_drafts_over_a_reduced_head_are_plain_decodings(files, monkeypatch):
    """Drafts chosen among the head's first 64 rows and the conversation's ids (DraftHead): greedy
    and sampled replies, cached ids, lengths and caches equal plain decoding's."""
    lm = models.load(files[0])
    init = MtpDrafts.__init__
    monkeypatch.setattr(MtpDrafts, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "draft_rows": 64}))
    monkeypatch.setattr(PromptLookup, "propose", lambda self, k: [])  # (every draft the layer's)
    prompt = [5, 200, 17, 250, 40, 300, 42, 99, 7]  # (ids past the 64 rows: draftable once seen)
    for cfg in (GREEDY, SAMPLED):
        plain = reply(session(lm, "off"), cfg, prompt)
        s = session(lm)
        assert s._mtp.vocab.prefix is not None and s._mtp.vocab.rows == 64
        same(reply(s, cfg, prompt), plain)
        assert s.last_stats.drafted > 0 and len(s._mtp.vocab.extra_ids) > 0
        assert "(chosen among the head's first 64 rows and the conversation's tokens)" in s.speculation_text
    monkeypatch.setattr(MtpDrafts, "__init__", init)
    assert "chosen among" not in session(lm).speculation_text  # (320 rows: the whole head)


def test_a_verify_hands_the_layer_the_rows_steps_would(lm):
    """The model's final-normed rows the MTP layer reads: a verify of several tokens hands over
    each row bit for bit as the one-token steps feeding them would (each row normed on its own, as
    the step norms its one)."""
    tokens = [7, 19, 3, 44, 12]
    rows = []
    for verify in (False, True):
        s = session(lm)
        s.prefill(PROMPT)
        if verify:
            s._forward(tokens, verify=True)
        else:
            for t in tokens:
                s.step(t)
        rows.append(s._mtp.rows[len(PROMPT):len(PROMPT) + len(tokens)].clone())
    assert torch.equal(rows[0], rows[1])
