"""Regression test of the original bug: a reused session must re-zero fixed recurrent state.

A synthetic recurrent decoder whose logits are a direct function of the conv state a forward
finds: with s = sum(incoming window), logits = -(arange(V) - s)^2, so greedy decoding emits s
itself, and each forward pushes 1 into the window. From a zero state the first logit's argmax is
0 and the emitted values strictly grow (0, 1, 2, ...), proving the state feeds the logits; any
state leaked from generation 1 into generation 2 changes generation 2's first token. Pure tensor
ops, so the same model runs eagerly on the CPU and inside a CUDA graph. Non-vacuity: with the
re-zero disabled through engine.state's test-only switch, the same check fails (asserted below).
"""
import pytest
import torch
from torch import nn

from engine import state as state_mod
from engine.config import SamplingConfig
from engine.session import DecodeSession
from models.architectures.state_spec import FixedState

WINDOW, VOCAB, STEPS = 16, 32, 7


class SyntheticRecurrentDecoder(nn.Module):
    class config:  # noqa: N801 - mirrors model.config
        vocab_size = VOCAB

    max_position = 1 << 16

    def state_spec(self):
        return [FixedState((("conv", (1, WINDOW), torch.float32),))]

    def forward(self, tokens, positions, state, all_logits=False):
        conv = state.fixed(0)["conv"]
        grid = torch.arange(VOCAB, device=conv.device, dtype=torch.float32)
        rows = []
        for _ in range(tokens.shape[0]):
            incoming = conv.sum()
            rows.append(-(grid - incoming) ** 2)
            conv.copy_(torch.cat([conv[:, 1:], torch.ones_like(conv[:, :1])], dim=1))
        logits = torch.stack(rows)
        return logits if all_logits else logits[-1:]


def two_generations(device: str, cuda_graph: str = "off"):
    # checkpoints off: the second generation must go through reset(), the path of the original bug
    s = DecodeSession(SyntheticRecurrentDecoder(), max_context=64, device=torch.device(device),
                      dtype=torch.float32, cuda_graph=cuda_graph, checkpoint_mib=0)
    cfg = SamplingConfig(temperature=0, max_new_tokens=STEPS)
    return [list(s.generate([1], cfg)) for _ in range(2)], s


def check(generations):
    first, second = generations
    assert first == second
    assert first[0] == 0  # the first logit's argmax: the incoming state was zero
    assert all(b > a for a, b in zip(first, first[1:])), first  # the state feeds the logits


DEVICES = [("cpu", "off"), pytest.param("cuda", "on", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,graph", DEVICES)
def test_reset_rezeroes_recurrent_state_on_reused_session(device, graph):
    generations, s = two_generations(device, graph)
    check(generations)
    assert (s.graph is not None) == (graph == "on")


@pytest.mark.parametrize("device,graph", DEVICES)
def test_regression_test_fails_without_the_rezero(monkeypatch, device, graph):
    monkeypatch.setattr(state_mod, "_REZERO_FIXED_STATE", False)
    generations, _ = two_generations(device, graph)
    with pytest.raises(AssertionError):
        check(generations)


def test_pure_kv_models_have_no_fixed_state(tiny_dirs):
    import models
    lm = models.load(tiny_dirs["llama"][0])
    s = DecodeSession(lm.model, max_context=32, device=torch.device("cpu"), dtype=torch.float32)
    assert s.state.fixed_tensors() == [] and not s.state.has_fixed_state


def test_scrub_kv_zeroes_the_first_slots_only(tiny_dirs):
    """What the CUDA kernel precompile leaves in the slots its throwaway forwards wrote (maybe not
    finite) is zeroed; the slots after them and the length are untouched."""
    import models
    lm = models.load(tiny_dirs["llama"][0])
    s = DecodeSession(lm.model, max_context=32, device=torch.device("cpu"), dtype=torch.float32)
    for i in range(len(lm.model.model.layers)):
        for t in s.state.kv(i):
            t.fill_(float("nan"))
    s.state.scrub_kv(3)
    for i in range(len(lm.model.model.layers)):
        for t in s.state.kv(i):
            assert int(t[:, :3].count_nonzero()) == 0 and bool(t[:, 3:].isnan().all())
    assert s.state.length == 0


# The same regression on each hybrid family's real layers (tiny random checkpoints): a reused
# session without checkpoints goes through reset(), and must compute what a fresh one does. The
# logits are compared, not only the tokens: a tiny random model's argmax can ignore its state.
FAMILIES = ["qwen3_5", "lfm2", "olmo_hybrid"]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    import models
    from tests.support.tiny import write_checkpoint
    return {k: models.load(write_checkpoint(k, str(tmp_path_factory.mktemp(k)))) for k in FAMILIES}


def family_runs(lm, speculative="off"):
    """(a fresh session's tokens and prompt logits, a reused session's two generations and, after
    reset(), its prompt logits); the reused session with `speculative` (the fresh one without),
    drafting the fresh reply with every third token wrong, so that drafts are kept and rolled back."""
    from engine.speculative import PromptLookup
    cfg = SamplingConfig(temperature=0, max_new_tokens=8)
    prompt = torch.randint(3, 300, (23,), generator=torch.Generator().manual_seed(1)).tolist()

    def new(mode="off"):
        return DecodeSession(lm.model, max_context=64, device=torch.device("cpu"), dtype=torch.float32,
                             checkpoint_mib=0, speculative=mode)
    fresh = new()
    fresh_ids, fresh_logits = list(fresh.generate(prompt, cfg)), new().prefill(prompt, all_logits=True)
    class Drafts(PromptLookup):  # the fresh reply from where this one is, every third draft wrong
        def propose(self, k):
            at = len(self.tokens) - len(prompt)
            return [t if (at + i) % 3 else t + 1 for i, t in enumerate(fresh_ids[at:at + k])]

    s = new(speculative)
    s._drafter = lambda ctx, expected=None: Drafts(ctx)
    s._depth.observe_cost(1, 1.0)  # (a step's cost known, so that the first steps already draft)
    s._depth.observe_cost(1, 1.0)
    gens = [list(s.generate(prompt, cfg)) for _ in range(2)]
    drafted = s.last_stats.drafted
    s.reset()
    return (fresh_ids, fresh_logits), (gens, s.prefill(prompt, all_logits=True)), drafted


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("speculative", ["off", "auto"])
def test_family_reused_session_rezeroes_its_fixed_state(family_models, kind, speculative):
    """With speculation (each family's C++ step verifies) the reused session's rejected drafts are
    rolled back too: the same tokens and logits."""
    (ids, logits), ((first, second), reused), drafted = family_runs(family_models[kind], speculative)
    assert first == second == ids
    assert torch.equal(reused, logits)
    assert (drafted > 0) == (speculative == "auto")


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_regression_test_fails_without_the_rezero(family_models, monkeypatch, kind):
    monkeypatch.setattr(state_mod, "_REZERO_FIXED_STATE", False)
    (ids, logits), (_, reused), _ = family_runs(family_models[kind])
    # the leaked state reaches the logits (bitwise equal with the re-zero; tiny LFM2's logits are
    # ~0.1 in size and its leak, two conv inputs, moves them by ~1e-4)
    assert (reused - logits).abs().max() > 1e-5


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    return {k: write_checkpoint(k, str(tmp_path_factory.mktemp(k)), model=hf_model(k))
            for k in ("qwen3_5_moe", "qwen3_moe")}


def moe_generations(path):
    """Two seeded generations of one prompt on one session, checkpoints off (so the second goes
    through reset()), and a cold session's."""
    import models
    lm = models.load(path)
    cfg = SamplingConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=5, max_new_tokens=12)
    prompt = list(range(3, 40))
    s = DecodeSession(lm.model, max_context=128, device=torch.device("cpu"), dtype=torch.float32, checkpoint_mib=0)
    cold = DecodeSession(lm.model, max_context=128, device=torch.device("cpu"), dtype=torch.float32,
                         checkpoint_mib=0)
    return [list(s.generate(prompt, cfg)) for _ in range(2)], list(cold.generate(prompt, cfg)), s


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_moe_models_reset_to_a_cold_state(moe_dirs, kind):
    (first, second), cold, s = moe_generations(moe_dirs[kind])
    assert first == second == cold
    assert s.state.has_fixed_state == (kind == "qwen3_5_moe")


def test_moe_hybrid_regression_fails_without_the_rezero(moe_dirs, monkeypatch):
    monkeypatch.setattr(state_mod, "_REZERO_FIXED_STATE", False)
    (first, second), cold, _ = moe_generations(moe_dirs["qwen3_5_moe"])
    assert first == cold and second != cold
