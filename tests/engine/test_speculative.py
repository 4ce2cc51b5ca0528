"""Speculative decoding (engine/speculative.py, DecodeSession._decode) against plain decoding.

The C++ step's verify feeds several tokens in one call with each row's logits bit for bit a
one-token step's (the row-exact linears, block_linear_rows); on that, a reply with drafts equals
the reply without, token for token, and leaves the same state (KV, and LFM2's conv windows and
Qwen3.5's DeltaNet states restored from the verify's rows): greedy and seeded sampled, with
drafts all right, all wrong, or right at random, a stop id or the token limit among accepted
drafts, the context's end, and a reader that stops reading (Ctrl-C).
"""
import random

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import models
from engine.config import ConfigError, SamplingConfig
from engine.session import DecodeSession
from engine.speculative import Depth, PromptLookup
from models.kernels.cpu import step as cpu_step
from tests.support.blocks import QUANTIZED, Q4_K_M, lfm2_in_blocks, random_blocks, tiny_gguf
from tests.support.hybrid import q8_0_gguf, tiny as tiny_hybrid
from tests.support.speculative import Always, kv_live

GREEDY = SamplingConfig(temperature=0, max_new_tokens=48)
SAMPLED = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, min_p=0.0, seed=11, max_new_tokens=48,
                         repetition_penalty=1.1)
PROMPT = [5, 9, 200, 7, 7, 31, 4, 100, 12, 40, 41, 42, 43, 12, 40, 41]

# (kind, linear type, per-tensor types, embedding/head type, cpu_int8): 4-bit repacked to torch's
# int4 kernel, GGUF blocks read as stored (32-weight and K-quant types, a K-quant head), int8 inputs
GGUFS = [("llama", Q.Q4_0, None, Q.Q8_0, False), ("qwen2", Q.Q4_1, None, Q.Q8_0, False),
         ("llama", Q.Q4_K, Q4_K_M, Q.Q6_K, False), ("qwen2", Q.Q5_1, {"attn_v.weight": Q.Q8_0}, Q.Q5_0, False),
         ("llama", Q.Q4_K, Q4_K_M, Q.Q6_K, True), ("qwen2", Q.Q5_0, None, Q.Q8_0, True),
         ("lfm2", Q.Q4_0, None, None, False), ("lfm2", Q.Q8_0, None, None, True),
         ("qwen3_5", Q.Q4_0, None, None, False), ("qwen3_5", Q.Q8_0, None, None, True),
         ("olmo_hybrid", Q.Q8_0, None, None, False),
         ("qwen3_5_moe", Q.Q8_0, None, None, False), ("qwen3_5_moe", Q.Q8_0, None, None, True),
         ("qwen3_next", Q.Q8_0, None, None, True),
         ("granitemoehybrid_e5", Q.Q8_0, None, None, False), ("nemotron_h", Q.Q8_0, None, None, True)]
IDS = [f"{k}-{q.name}-head_{e.name if e else 'tied'}{'-int8' if i8 else ''}" for k, q, t, e, i8 in GGUFS]


@pytest.fixture(scope="module", params=GGUFS, ids=IDS)
def gguf_lm(request, tmp_path_factory):
    kind, linear, types, embed, int8 = request.param
    if kind == "lfm2":  # (short-conv layers: their windows rolled back from the verify's rows)
        lm = lfm2_in_blocks(tmp_path_factory.mktemp("spec"), linear)
    elif kind in ("qwen3_5", "olmo_hybrid"):  # (DeltaNet layers: conv windows and recurrent states rolled back alike)
        lm = tiny_hybrid(tmp_path_factory.mktemp("spec"), linear, tiled=linear == Q.Q4_0, kind=kind)
    elif kind in ("qwen3_5_moe", "qwen3_next"):  # (routed experts in GGUF blocks: each verify row routes on its own)
        # (every layer routed: llama.cpp's converter maps no dense MLP in a Qwen3-Next)
        over = {"mlp_only_layers": []} if kind == "qwen3_next" else {}
        lm = q8_0_gguf(tmp_path_factory.mktemp("spec"), kind, ("--no-mtp",), **over)
    elif kind in ("granitemoehybrid_e5", "nemotron_h"):  # (Mamba2 conv windows and ssm states rolled back)
        lm = q8_0_gguf(tmp_path_factory.mktemp("spec"), kind)
    else:
        lm = models.load(tiny_gguf(tmp_path_factory.mktemp("spec"), kind, linear, types, embed), quantized=True)
    if int8:
        models.use_int8_inputs(lm.model, True)
    return lm


def session(lm, speculative="lookup", max_context=256):
    s = DecodeSession(lm.model, max_context=max_context, device=torch.device("cpu"), dtype=torch.float32,
                      cpu_kernel="on", speculative=speculative)
    assert isinstance(s._step_fn, cpu_step.CpuStep)  # (HybridStep is one)
    return s


class Fixed:
    """A drafter that proposes what `guess(context, k)` says (the tests' drafts)."""

    def __init__(self, guess):
        self.guess, self.tokens = guess, []

    def __call__(self, context, expected=None):
        self.tokens = list(context)
        return self

    def extend(self, ids):
        self.tokens += list(ids)

    def propose(self, k):
        return self.guess(self.tokens, k)


def run(s, cfg, prompt=PROMPT, stop_ids=None, close_after=None):
    out = []
    gen = s.generate(prompt, cfg, stop_ids=stop_ids)
    for t in gen:
        out.append(t)
        if close_after is not None and len(out) == close_after:
            gen.close()
            break
    return out, list(s.cached), s.state.length, s.state.written, kv_live(s)


def same(a, b):
    assert a[:4] == b[:4]
    assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))


def test_verify_rows_are_steps_bit_for_bit(gguf_lm):
    """The step's verify of 6 tokens against 6 steps after the same prefix: equal logits, and the
    KV slots they wrote equal."""
    s = session(gguf_lm, "off")
    toks = [3, 77, 5, 120, 9, 9]
    s.prefill(PROMPT)
    before = s.state.snapshot().fixed
    steps = torch.stack([s.step(t)[-1] for t in toks])
    kv_steps = kv_live(s)
    s.state.unfeed(len(toks), before)
    rows = s._forward(toks, verify=True)
    assert torch.equal(rows, steps)
    assert all(torch.equal(a, b) for a, b in zip(kv_live(s), kv_steps))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("int8", [False, True])
def test_block_linear_rows_are_one_row_products(qtype, int8):
    """block_linear_rows: each row of a 7-row product is the one-row product's bits (the decode
    kernel's), for every block type, on fp32 and on int8 inputs; the prefill's product of the
    same rows is not bound to them (it sums in another order)."""
    cpu_step.load()
    ops = torch.ops.chat_cpu
    raw = torch.from_numpy(random_blocks(qtype, rows=53, blocks_per_row=8 if qtype < Q.Q4_K else 2, seed=4))
    x = torch.randn(7, ops.block_dequant(raw, int(qtype)).shape[1], generator=torch.Generator().manual_seed(1))
    rows = ops.block_linear_rows(x, raw, int(qtype), int8)
    one = torch.cat([ops.block_linear(x[t:t + 1].contiguous(), raw, int(qtype), int8) for t in range(7)])
    assert torch.equal(rows, one)


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafts", ["right", "wrong", "random"])
def test_replies_and_state_equal_plain_decoding(gguf_lm, cfg, drafts):
    """Drafts from the plain reply itself (all right), from nowhere (all wrong), or right at random
    positions: the same tokens, cached ids, lengths and KV as plain decoding, at depths 1 to 7."""
    plain = run(session(gguf_lm, "off"), cfg)
    reply, rng = plain[0], random.Random(5)

    def guess(ctx, k):
        at = len(ctx) - len(PROMPT)  # the reply's tokens so far
        right = reply[at:at + k]
        if drafts == "wrong":
            return [(t + 1) % gguf_lm.model.config.vocab_size for t in right] or [1] * k
        if drafts == "random":
            return [t if rng.random() < 0.6 else (t + 3) % 256 for t in right] or [2] * k
        return right
    for depth in (1, 3, 7):
        s = session(gguf_lm)
        s._drafter, s._depth = Fixed(guess), Always(depth)
        got = run(s, cfg)
        same(got, plain)
        assert s.last_stats.drafted > 0
        if drafts == "right":
            assert s.last_stats.accepted == s.last_stats.drafted > 0
        if drafts == "wrong":
            assert s.last_stats.accepted == 0


@pytest.mark.parametrize("end", ["stop", "length", "context", "closed"])
def test_a_reply_ending_among_accepted_drafts(gguf_lm, end):
    """The reply ends at a token that was an accepted draft with more drafts fed after it: a stop
    id, the token limit, the context's end, the reader closing the generator. The rows fed past
    it are unfed: the state is plain decoding's."""
    base = run(session(gguf_lm, "off"), SAMPLED)[0]  # (sampled: a varied reply, a stop id to pick)
    cut = next(i for i in range(9, len(base)) if base[i] not in base[:i])
    stop_ids = (base[cut],) if end == "stop" else None
    cfg = SAMPLED.replace(max_new_tokens=cut + 1) if end == "length" else SAMPLED
    max_context = len(PROMPT) + cut if end == "context" else 256
    close_after = cut + 1 if end == "closed" else None
    kw = dict(stop_ids=stop_ids, close_after=close_after)
    plain = run(session(gguf_lm, "off", max_context), cfg, **kw)
    s = session(gguf_lm, "lookup", max_context)
    s._drafter, s._depth = Fixed(lambda ctx, k: (base + [1] * 8)[len(ctx) - len(PROMPT):][:k]), Always(7)
    got = run(s, cfg, **kw)
    same(got, plain)
    assert len(got[0]) == cut + 1 and s.last_stats.accepted > 0


def test_prompt_lookup_on_a_copy_task(gguf_lm):
    """The n-gram drafter on a reply that repeats its prompt (forced by a prompt that is a
    repeated pattern): drafts are proposed and kept, the reply is plain decoding's."""
    prompt = [10, 11, 12, 13, 14, 15, 16, 17] * 6
    plain = run(session(gguf_lm, "off"), GREEDY, prompt=prompt)
    s = session(gguf_lm, "lookup")
    got = run(s, GREEDY, prompt=prompt)
    same(got, plain)
    ctx = prompt + plain[0]  # drafts wherever the last two tokens occurred before (within the reply)
    repeats = any(tuple(ctx[e - 2:e]) in {tuple(ctx[i:i + 2]) for i in range(e - 2)}
                  for e in range(len(prompt) + 1, len(ctx)))
    assert s.last_stats.drafted > 0 or not repeats


class EvenIds:
    """A TokenConstraint allowing even ids only, ending after `length` tokens (then only id 0)."""

    def __init__(self, vocab, length=30):
        self.mask_words, self.vocab, self.left = (vocab + 31) // 32, vocab, length

    def fill_mask(self, out):
        bits = torch.zeros(self.mask_words * 32, dtype=torch.bool)
        if self.left > 0:
            bits[:self.vocab:2] = True
        else:
            bits[0] = True
        packed = torch.zeros(self.mask_words, dtype=torch.int64)
        for b in range(32):
            packed |= bits.view(-1, 32)[:, b].long() << b
        out.copy_(packed.to(torch.int64).apply_(lambda v: v - (1 << 32) if v >= 1 << 31 else v).to(torch.int32))

    def consume(self, token):
        self.left -= 1
        return token % 2 == 0 or self.left < 0

    def error(self):
        return ""


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_constrained_and_forced_replies_equal_plain_decoding(gguf_lm, cfg):
    """An output format's mask (advanced by each kept draft before the next row is drawn) and
    teacher-forced ids (the recording drafted; departures noted as without drafts): the same
    tokens, departures and state as plain decoding, drafts right at random."""
    vocab = gguf_lm.model.config.vocab_size
    plain_s = session(gguf_lm, "off")
    plain = run_with(plain_s, cfg, constraint=EvenIds(vocab))
    reply, rng = plain[0], random.Random(2)
    s = session(gguf_lm)
    s._drafter = Fixed(lambda ctx, k: [t if rng.random() < 0.7 else t + 1 for t in reply[len(ctx) - len(PROMPT):][:k]])
    s._depth = Always(4)
    same(run_with(s, cfg, constraint=EvenIds(vocab)), plain)
    assert s.last_stats.accepted > 0 and all(t % 2 == 0 for t in reply[:30])
    forced = [t if i % 7 else (t + 3) % vocab for i, t in enumerate(reply[:40])]  # departures every 7th
    plain_s = session(gguf_lm, "off")
    want = run_with(plain_s, cfg, forced=forced)
    s = session(gguf_lm)
    same(run_with(s, cfg, forced=forced), want)
    assert s.last_stats.departures == plain_s.last_stats.departures and s.last_stats.departures
    assert s.last_stats.finish_reason == plain_s.last_stats.finish_reason and s.last_stats.accepted > 20


def run_with(s, cfg, **kw):
    out = list(s.generate(PROMPT, cfg, **kw))
    return out, list(s.cached), s.state.length, s.state.written, kv_live(s)


def test_an_expected_reply_is_verified_in_few_forwards(gguf_lm):
    """generate(expected=...) (a replay's recorded reply) drafts it: every draft kept, the reply
    and state plain decoding's, in fewer forwards than tokens; a wrong expectation changes nothing."""
    plain = run(session(gguf_lm, "off"), SAMPLED)
    for expected, all_kept in ((plain[0], True), ([t ^ 1 for t in plain[0]], False)):
        s = session(gguf_lm)
        out = list(s.generate(PROMPT, SAMPLED, expected=expected))
        same((out, list(s.cached), s.state.length, s.state.written, kv_live(s)), plain)
        st = s.last_stats
        if all_kept:
            assert st.accepted == st.drafted > 0 and st.verifies < len(out) // 2


@pytest.mark.slow
def test_the_embedded_model_speculates_exactly(smollm2_q4):
    """The embedded model's 4-bit linears and Q8 head: the self-check passes, a copy-with-edit
    prompt's greedy and sampled replies equal plain decoding's, and drafts are kept."""
    tok = smollm2_q4.tokenizer
    text = ("<|im_start|>user\nRepeat exactly: The keeper, a quiet man named Tobias, climbed the spiral stairs "
            "each evening at dusk.<|im_end|>\n<|im_start|>assistant\n")
    prompt = tok.encode(text, add_special_tokens=False).ids
    eos = tuple(t for t in (tok.token_to_id("<|im_end|>"),) if t is not None)
    for cfg in (GREEDY, SAMPLED):
        plain = run(session(smollm2_q4, "off", 512), cfg, prompt=prompt, stop_ids=eos)
        s = session(smollm2_q4, "lookup", 512)
        assert s.speculating and s._spec_checked is True
        got = run(s, cfg, prompt=prompt, stop_ids=eos)
        same(got, plain)
        assert s.last_stats.accepted > 0 or cfg is SAMPLED  # (the greedy reply copies; a sampled one may not)


@pytest.fixture(scope="module")
def smollm2_q4():
    return models.load("smollm2", quantized=True)


def test_a_failed_self_check_turns_speculation_off(gguf_lm, monkeypatch):
    """A verify whose rows differ from steps (a kernel summing rows otherwise): auto decodes
    without drafts and says why; lookup is refused with the reason."""
    real = cpu_step.CpuStep.verify
    monkeypatch.setattr(cpu_step.CpuStep, "verify", lambda self, *a: real(self, *a) * (1 + 1e-7))
    s = session(gguf_lm, "auto")
    assert not s.speculating and "self-check" in s.speculation_text
    with pytest.raises(ConfigError, match="speculative: lookup is unavailable here"):
        session(gguf_lm, "lookup")


def test_unavailable_paths_say_why(tiny_dirs):
    """The torch step (no verify) and speculative: lookup: a ConfigError naming the cause; auto:
    off with the reason in /show's words."""
    lm = models.load(tiny_dirs["llama"][0])
    kw = dict(max_context=64, device=torch.device("cpu"), dtype=torch.float32, cpu_kernel="off")
    with pytest.raises(ConfigError, match="no exact multi-token verify"):
        DecodeSession(lm.model, speculative="lookup", **kw)
    s = DecodeSession(lm.model, speculative="auto", **kw)
    assert not s.speculating and s.speculation_text.startswith("auto: off here (no exact multi-token verify")
    with pytest.raises(ConfigError):
        s.set_speculative("sometimes")


def test_prompt_lookup_drafter():
    d = PromptLookup([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert d.propose(3) == [4, 5, 9]  # the longest suffix seen before (1 2 3), what followed it
    d.extend([7])
    assert d.propose(2) == []  # "3 7" never occurred before
    d = PromptLookup([4, 4, 4, 4])
    assert d.propose(2) == [4]  # the latest earlier occurrence ends one before the end
    assert PromptLookup([1]).propose(4) == [] and PromptLookup([1, 2, 1, 2]).propose(0) == []


def test_expected_reply_is_drafted_first():
    """A replay's recorded reply: drafted while the reply follows it, then the n-gram lookup."""
    d = PromptLookup([1, 2, 3, 1, 2], expected=[9, 8, 7, 6])
    assert d.propose(3) == [9, 8, 7]
    d.extend([9, 8])
    assert d.propose(5) == [7, 6]
    d.extend([5])  # the reply left the recording: lookup from here ("8 5" never occurred)
    assert d.propose(3) == []
    d.extend([1, 2])
    assert d.propose(2) == [9, 8]  # (1 2 followed by 9 at its latest occurrence)


def test_depth_follows_acceptance_and_cost():
    d = Depth()
    for r in range(1, 9):
        d.observe_cost(r, 50.0)  # a size's first timing (its allocations) is not counted
        d.observe_cost(r, 1.0 + 0.25 * (r - 1))
    assert d.cost(4) == 1.75
    for _ in range(30):
        d.observe(7, 7)
    assert d.choose(7) == 7 and d.choose(2) == 2 and d.choose(0) == 0
    for _ in range(60):
        d.observe(0, 3)
    picks = [d.choose(7) for _ in range(64)]
    assert picks.count(0) >= 62 and 1 in picks  # plain steps, with one draft tried now and then


COPY = "Repeat exactly: The keeper, a quiet man named Tobias, climbed the spiral stairs each evening at dusk."


@pytest.mark.slow
def test_the_repl_shows_sets_and_reports_it(tmp_path):
    """The embedded model in the REPL: /show names the mode and where it came from, /stats the
    drafts kept, /set switches the live session (a bad value is one line; the REPL goes on), and
    the reply with it off is the reply with it on."""
    from tests.support.cli import run_chat
    p = run_chat("--temperature", "0", "--max-new-tokens", "40", tmp_path=tmp_path,
                 stdin=f"/show\n{COPY}\n/stats\n/set speculative maybe\n/set speculative off\n/show\n/retry\n/stats\n/exit\n")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "speculative: auto: prompt-lookup drafts, up to 7 a verify" in p.stdout
    assert "speculative: off (/set)" in p.stdout
    assert "speculative: 'maybe' is not valid; allowed: auto | off | lookup" in p.stdout + p.stderr
    assert "kept (" in p.stdout and " verifies · " in p.stdout
    lines = p.stdout.splitlines()
    stats = [i for i, line in enumerate(lines) if " tok/s · " in line]
    assert len(stats) == 2 and "drafts " in lines[stats[0]] and "drafts " not in lines[stats[1]]
    assert lines[stats[0] - 1] == lines[stats[1] - 1]  # the reply (speculative on), the /retry's (off)


@pytest.mark.slow
def test_lookup_where_it_cannot_run_is_one_line(tmp_path):
    from tests.support.cli import run_chat
    p = run_chat("--cpu-kernel", "off", "--speculative", "lookup", "--prompt", "hi", tmp_path=tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].endswith(
        "speculative: lookup is unavailable here (no exact multi-token verify for this decode path (the C++ "
        "CPU step of the dense GQA models, LFM2 and the DeltaNet and Mamba2 hybrids has one)); use auto or off")


@pytest.mark.slow
def test_a_recording_replays_with_it_on_and_off(tmp_path):
    """A script recorded with speculation on (a /set turning it off midway) replays exactly with
    it off and on; the replay drafts the recorded reply (engine/speculative.py)."""
    from tests.support.cli import run_chat
    script = tmp_path / "s.yaml"
    script.write_text("format: chat-transcript\nversion: 1\nsampling: {temperature: 0, max_new_tokens: 30}\n"
                      f"events:\n- user: '{COPY}'\n- command: /set speculative off\n- user: And once more.\n")
    rec = tmp_path / "r.yaml"
    p = run_chat("run", script, "-o", rec, tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    for flag in ("off", "auto"):
        p = run_chat("replay", rec, "--runs", "1", "--speculative", flag, tmp_path=tmp_path)
        assert p.returncode == 0, p.stdout + p.stderr
