"""Checkpoint retention by need, budgets (auto, one slot) and spilling to host memory.

The policy is engine/state.py's docstring: the newest prompt checkpoint (/retry, Ctrl-C) goes
last, the newest base checkpoint (/undo) next to last, the others oldest first; an evicted device
checkpoint moves to the host ring where there is one.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from chat.turn import TurnResult
from engine.config import ConfigError, EngineConfig, coerce
from engine.state import BASE, PROMPT, StateManager
from models.architectures.state_spec import AttentionState, FixedState
from tests.support.checkpoints import WORDS, cold_tokens, controller, send_checked

SPEC = [FixedState([("h", (4,), None)]), AttentionState(n_kv_heads=1, head_dim=2)]
SLOT = 4 * 4 + 4 * 8  # the fixed state's bytes + the logits' (vocab 8, fp32)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from tests.support.tiny import hf_model, write_checkpoint
    return write_checkpoint("qwen3_5", str(tmp_path_factory.mktemp("qwen3_5")), model=hf_model("qwen3_5"))


def manager(slots: int, host_slots: int = 0) -> StateManager:
    return StateManager(SPEC, 64, torch.device("cpu"), torch.float32, vocab_size=8,
                        checkpoint_budget=slots * SLOT, host_budget=host_slots * SLOT)


def advance_to(m: StateManager, n: int, value: float) -> None:
    m.begin_forward(n - m.length)
    m.fixed(0)["h"].fill_(value)
    m.advance(n - m.length)


def test_the_newest_prompt_checkpoint_outlives_a_newer_base_and_an_older_one_goes_first():
    m = manager(2)
    advance_to(m, 10, 1.0)
    m.checkpoint(torch.zeros(8), role=PROMPT)  # the newest prompt: kept, though it is the oldest
    advance_to(m, 20, 2.0)
    m.checkpoint(role=BASE)
    advance_to(m, 30, 3.0)
    m.checkpoint(role=BASE)  # the ring is full: the older base goes, not the older prompt
    assert sorted((c.length, c.role) for c in m.checkpoints) == [(10, PROMPT), (30, BASE)]
    assert m.restore_nearest(25) == 10 and float(m.fixed(0)["h"][0]) == 1.0


def test_one_slot_holds_the_newest_prompt_checkpoint():
    m = manager(1)
    advance_to(m, 10, 1.0)
    m.checkpoint(torch.zeros(8), role=PROMPT)
    advance_to(m, 20, 2.0)
    m.checkpoint(role=BASE)  # less needed than the prompt's end: not taken
    assert [(c.length, c.role) for c in m.checkpoints] == [(10, PROMPT)]
    advance_to(m, 30, 3.0)
    m.checkpoint(torch.ones(8), role=PROMPT)
    assert [(c.length, c.role) for c in m.checkpoints] == [(30, PROMPT)]


def test_a_checkpoint_above_the_live_length_survives_a_rewind_until_a_forward_writes_below_it():
    m = manager(4)
    advance_to(m, 10, 1.0)
    m.checkpoint(role=BASE)
    advance_to(m, 20, 2.0)
    m.checkpoint(torch.zeros(8), role=PROMPT)
    advance_to(m, 25, 3.0)
    assert m.restore_nearest(12) == 10 and m.written == 25
    assert m.best_at_most(20) == 20  # the KV below 20 is untouched: its checkpoint still serves
    m.goto(20)
    assert float(m.fixed(0)["h"][0]) == 2.0 and m.length == 20
    m.goto(10)
    m.begin_forward(1)  # a forward at 10 overwrites the KV under the checkpoint at 20
    assert [c.length for c in m.checkpoints] == [10] and m.written == 10


def test_spilled_checkpoints_restore_exactly_from_host_memory():
    m = manager(1, host_slots=3)
    for i, n in enumerate((10, 20, 30, 40), start=1):
        advance_to(m, n, float(i))
        m.checkpoint(torch.full((8,), float(i)), role=PROMPT)
    # one on the device (the newest), three spilled
    assert sorted((c.length, c.on_host) for c in m.checkpoints) == [(10, True), (20, True), (30, True), (40, False)]
    assert m.restore_nearest(25) == 20 and float(m.fixed(0)["h"][0]) == 2.0
    assert m.checkpoint_logits(10).tolist() == [1.0] * 8
    assert "1 on the device, 3 spilled" in m.describe() and "host ring 3 slots" in m.describe()


def test_the_host_ring_keeps_the_more_needed_checkpoints():
    m = manager(1, host_slots=1)
    for i, n in enumerate((10, 20, 30), start=1):
        advance_to(m, n, float(i))
        m.checkpoint(torch.zeros(8), role=PROMPT if i == 1 else BASE)
    # the device keeps the most needed (the prompt's end), the host the newest base; the base at 20
    # is the least needed of all, and the host ring's one slot goes to the newer one
    assert sorted((c.length, c.role, c.on_host) for c in m.checkpoints) == [(10, PROMPT, False), (30, BASE, True)]


def test_checkpoint_budgets_auto_or_mib():
    assert EngineConfig().checkpoint_mib == "auto" and EngineConfig().checkpoint_host_mib == "auto"
    assert coerce(EngineConfig, "checkpoint_mib", "512") == 512
    assert coerce(EngineConfig, "checkpoint_mib", "AUTO") == "auto"
    with pytest.raises(ConfigError, match="checkpoint_mib: 'lots' is not valid; allowed: auto, 0"):
        coerce(EngineConfig, "checkpoint_mib", "lots")
    with pytest.raises(ConfigError, match="allowed: auto, 0"):
        EngineConfig(checkpoint_host_mib=-1)
    auto = StateManager(SPEC, 64, torch.device("cpu"), torch.float32, vocab_size=8, checkpoint_budget="auto")
    assert auto.budget > 0 and len(auto._slots) == 32 and "(auto)" in auto.describe()


def test_ctrl_c_then_the_same_message_draws_from_the_prompt_checkpoint(hybrid):
    c = controller(hybrid, temperature="0", max_new_tokens="20")
    list(c.send("alpha", TurnResult([])))
    gen = c.send("beta", TurnResult([]))
    next(gen)
    next(gen)
    with pytest.raises(KeyboardInterrupt):
        gen.throw(KeyboardInterrupt)
    r = TurnResult([])
    list(c.send("beta", r))  # the same message again: no forward before the first draw
    assert r.stats.prefilled_tokens == 0 and r.stats.reused_tokens == len(r.prompt_ids)
    assert r.ids == cold_tokens(c, r.prompt_ids, c.settings.sampling, r.stats.seed)


def test_undo_then_a_new_message_prefills_only_the_message(hybrid):
    c = controller(hybrid, temperature="0")
    list(c.send("alpha", TurnResult([])))
    r2 = TurnResult([])
    list(c.send("beta", r2))
    c.undo()
    r = TurnResult([])
    list(c.send("gamma", r))
    assert r.stats.reused_tokens == r2.stats.reused_tokens  # the base of the undone turn
    assert r.ids == cold_tokens(c, r.prompt_ids, c.settings.sampling, r.stats.seed)


OPS = st.lists(st.one_of(st.tuples(st.just("send"), st.sampled_from(WORDS)), st.just(("undo",)),
                         st.just(("retry",)), st.just(("interrupt", 1)), st.just(("interrupt", 3))),
               min_size=3, max_size=9)


@pytest.mark.slow
@pytest.mark.parametrize("host_mib", ["0", "1"])  # one device slot; then with a host ring beside it
def test_property_one_slot_and_spilling_equal_a_cold_session_and_retry_never_prefills(hybrid, host_mib,
                                                                                     monkeypatch):
    import engine.state
    monkeypatch.setattr(engine.state, "MAX_SLOTS", 1)  # the device ring; the host ring's cap is its own
    c = controller(hybrid, temperature="0.8", seed="3", max_new_tokens="8", checkpoint_host_mib=host_mib)
    assert len(c.session.state._slots) == 1 and (c.session.state.host_slots > 1) == (host_mib == "1")

    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
    @given(OPS)
    def run(ops):
        c.reset()
        just_sent = False
        for op in ops:
            if op[0] == "undo":
                c.undo()
                just_sent = False
                continue
            if op[0] == "interrupt":
                gen = c.send(WORDS[op[1]], TurnResult([]), seed=3)
                try:
                    next(gen)
                    gen.throw(KeyboardInterrupt)
                except (KeyboardInterrupt, StopIteration):
                    pass
                just_sent = False
                continue
            r = send_checked(c, op)
            if r is None:
                continue
            if op[0] == "retry" and just_sent:
                assert r.stats.prefilled_tokens == 0
            just_sent = True
    run()


@pytest.mark.gpu
def test_spilling_on_cuda_goes_through_pinned_memory_on_a_side_stream_and_restores_exactly():
    m = StateManager(SPEC, 64, torch.device("cuda"), torch.float32, vocab_size=8,
                     checkpoint_budget=2 * SLOT, host_budget=4 * 128)  # a pinned slot: a power of two
    assert len(m._slots) == 2 and m.host_slots == 4 and m._side is not None
    for i in range(1, 7):
        m.begin_forward(10)
        m.fixed(0)["h"].fill_(float(i))
        m.advance(10)
        m.checkpoint(torch.full((8,), float(i), device="cuda"), role=PROMPT if i % 2 else BASE)
    spilled = [c for c in m.checkpoints if c.on_host]
    assert spilled and all(m._host[c.slot].fixed[0]["h"].is_pinned() for c in spilled)
    for c in sorted(m.checkpoints, key=lambda c: -c.length):
        m.goto(c.length)
        assert m.fixed(0)["h"].tolist() == [c.length / 10] * 4
        if c.has_logits:
            assert m.checkpoint_logits(c.length).tolist() == [c.length / 10] * 8


@pytest.mark.gpu
def test_one_device_slot_and_a_host_ring_on_cuda_equal_a_cold_session(hybrid, monkeypatch):
    import engine.state
    monkeypatch.setattr(engine.state, "MAX_SLOTS", 1)
    c = controller(hybrid, temperature="0", device="cuda", dtype="float32", checkpoint_host_mib="1")
    assert len(c.session.state._slots) == 1 and c.session.state.host_slots > 1
    for op in ["alpha", "beta", "retry", "undo", "gamma", "delta", "interrupt", "delta", "undo", "undo", "why?"]:
        if op == "undo":
            c.undo()
            continue
        if op == "interrupt":
            gen = c.send("more please", TurnResult([]), seed=3)
            try:
                next(gen)
                gen.throw(KeyboardInterrupt)
            except (KeyboardInterrupt, StopIteration):
                pass
            continue
        r = TurnResult([])
        list(c.send(c.pop_for_retry() if op == "retry" else op, r, seed=3))
        assert r.ids == cold_tokens(c, r.prompt_ids, c.settings.sampling, 3)
        if op == "retry":
            assert r.stats.prefilled_tokens == 0
    assert any(x.on_host for x in c.session.state.checkpoints)
