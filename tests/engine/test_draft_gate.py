"""The draft gate: drafting that does not pay stops (probing at a bounded rate), drafting that pays goes on, and a
new request starts from what earlier requests found. Pure arithmetic on made-up outcomes; the engine-level
losslessness with the gate on is in tests/speculative (greedy output equals plain decoding)."""

from __future__ import annotations

from specserve.speculative.policy.draft_gate import (MAX_BACKOFF, PROBE_SHARE, PROBE_STEPS, RECHECK_FIRST, DraftGate,
                                                     GatePool)


def verify(n: float) -> float:
    return 0.010 + 0.001 * n  # a plain step 10 ms, each verified draft token 1 ms more


def run(gate: DraftGate, steps: int, accepted: int, nodes: int = 4, draft_seconds: float = 0.005) -> list[bool]:
    """`steps` steps where a full draft of `nodes` tokens gets `accepted` of them; returns which steps drafted."""
    drafted = []
    for _ in range(steps):
        full = gate.decide(verify)
        drafted.append(full)
        if full:
            gate.observe(True, 1 + accepted, nodes, draft_seconds, verify)
        else:
            gate.observe(False, 1, 0, 0.0, verify)
    return drafted


def test_a_draft_that_pays_keeps_drafting():
    gate = DraftGate(GatePool())
    # 3 of 4 accepted: 4 tokens for 5 + 14 ms, against 1 token for 10 ms
    assert all(run(gate, 200, accepted=3))


def test_a_draft_that_never_pays_is_probed_ever_more_rarely():
    gate = DraftGate(GatePool())
    drafted = run(gate, 400, accepted=0, nodes=1, draft_seconds=0.0005)  # a cheap probe: MAX_BACKOFF bounds it
    assert drafted[0]  # optimistic before any evidence
    starts = [i for i, d in enumerate(drafted) if d and not drafted[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert max(gaps) == MAX_BACKOFF + PROBE_STEPS  # a probe of two steps once per MAX_BACKOFF cheap steps at most
    assert gaps == sorted(gaps)  # ever rarer
    assert sum(drafted) < 2 * 400 / MAX_BACKOFF + 16


def test_the_gate_reopens_when_drafts_start_to_pay():
    gate = DraftGate(GatePool())
    run(gate, 200, accepted=0)
    later = run(gate, 200, accepted=4)
    assert sum(later[-100:]) == 100  # a winning probe reopens it for good


def test_a_new_request_starts_from_the_pool():
    pool = GatePool()
    run(DraftGate(pool), 300, accepted=0)
    newcomer = run(DraftGate(pool), 60, accepted=0)
    assert not newcomer[0]  # the pool says this head does not pay: no draft on the first step
    assert sum(newcomer) <= PROBE_STEPS


def test_drafting_seconds_are_learnt_from_steady_steps_only():
    gate = DraftGate(GatePool())
    gate.decide(verify)
    gate.observe(True, 2, 4, 0.5, verify)  # the first drafted step: catches up on the prompt, slow
    assert gate.full.draft_seconds is None
    gate.decide(verify)
    gate.observe(True, 2, 4, 0.004, verify)
    assert gate.full.draft_seconds == 0.004


def test_a_dear_probe_waits_until_its_cost_is_a_small_share():
    pool = GatePool()
    dear = 0.1  # drafting takes ten plain steps (a static tree scored by a large lm_head)
    drafted = []
    for _ in range(30):  # requests of 128 steps sharing the pool
        drafted += run(DraftGate(pool), 128, accepted=0, nodes=8, draft_seconds=dear)
    full_steps = sum(drafted[len(drafted) // 2:])
    extra = full_steps * (dear + verify(8) - verify(0))
    cheap = (len(drafted) // 2 - full_steps) * verify(0)
    assert pool.backoff > MAX_BACKOFF and extra < 2.5 * PROBE_SHARE * cheap


def run_measured(gate: DraftGate, steps: int, accepted: int, full_seconds: float, cheap_seconds: float,
                 nodes: int = 1) -> list[bool]:
    """As `run`, with the engine's measured wall time of each step (its drafting: 2 ms of it when drafted)."""
    drafted = []
    for _ in range(steps):
        full = gate.decide(verify)
        drafted.append(full)
        if full:
            gate.observe(True, 1 + accepted, nodes, 0.002, verify, step_seconds=full_seconds)
        else:
            gate.observe(False, 1, 0, 0.0, verify, step_seconds=cheap_seconds)
    return drafted


def test_measured_step_times_overrule_the_table():
    # by the table a 1-node draft accepted every time pays: 2 tokens for 2 + 11 ms against 1 for 10 ms; measured,
    # the drafted step takes 25 ms and the plain one 12 ms, so it does not
    table_only = run(DraftGate(GatePool()), 200, accepted=1, nodes=1, draft_seconds=0.002)
    measured = run_measured(DraftGate(GatePool()), 200, accepted=1, full_seconds=0.025, cheap_seconds=0.012)
    assert all(table_only)
    assert sum(measured[100:]) <= 2 * PROBE_STEPS


def test_the_cheap_step_is_measured_once_before_comparing():
    gate = DraftGate(GatePool())
    steps = run_measured(gate, 6, accepted=3, full_seconds=0.020, cheap_seconds=0.010, nodes=4)
    assert steps[:2] == [True, True] and not steps[2]  # catch-up, steady, then one cheap step to measure
    assert gate.cheap.seconds == 0.010 and gate.full.seconds == 0.020
    assert all(steps[3:])  # 4 tokens in 20 ms beat 1 in 10 ms


def test_an_open_gate_stays_open_on_a_small_win_and_a_closed_one_needs_a_clear_one():
    # 2 tokens in 19 ms against 1 in 10 ms: the full draft wins by 5%
    gate = DraftGate(GatePool())
    open_steps = run_measured(gate, 200, accepted=1, full_seconds=0.019, cheap_seconds=0.010)[100:]
    assert sum(open_steps) >= 100 - 100 // MAX_BACKOFF - 1  # drafting but for rechecks of the cheap step
    closed = DraftGate(GatePool())
    run_measured(closed, 100, accepted=0, full_seconds=0.019, cheap_seconds=0.010)  # a head that lost so far
    later = run_measured(closed, 200, accepted=1, full_seconds=0.019, cheap_seconds=0.010)
    assert sum(later) < 20  # probes only: 5% is within a two-step probe's noise
    much_better = run_measured(closed, 200, accepted=2, full_seconds=0.019, cheap_seconds=0.010)
    assert sum(much_better[-100:]) >= 100 - 100 // MAX_BACKOFF - 1  # 3 tokens in 19 ms: a clear win reopens it


def test_a_lucky_probe_halves_the_wait_instead_of_resetting_it():
    """A head near break-even: one probe wins (2 tokens), then drafts lose again. The wait before the next probe
    is half the long one it had, not one step."""
    gate = DraftGate(GatePool())
    run(gate, 300, accepted=0)
    long_wait = gate.backoff
    assert long_wait >= 32
    while not run(gate, 1, accepted=4)[0]:  # cheap steps up to the probe, whose drafts win
        pass
    run(gate, PROBE_STEPS - 1, accepted=4)
    assert not gate.closed and gate.backoff == long_wait // 2
    drafted = run(gate, 3 * long_wait, accepted=0)
    starts = [i for i, d in enumerate(drafted[1:], start=1) if d and not drafted[i - 1]]
    assert starts and starts[0] > long_wait // 2  # the next probe waits the halved backoff, not 1, 2, 4, ...


def test_an_open_gate_rechecks_the_cheap_step_ever_more_rarely_while_drafting_pays():
    gate = DraftGate(GatePool())
    drafted = run_measured(gate, 600, accepted=3, full_seconds=0.020, cheap_seconds=0.010, nodes=4)
    cheap = [i for i, d in enumerate(drafted) if not d]
    gaps = [b - a for a, b in zip(cheap, cheap[1:])]
    assert gaps[0] == RECHECK_FIRST + 1 and gaps == sorted(gaps) and max(gaps) == MAX_BACKOFF + 1
    assert len(cheap) < 600 / MAX_BACKOFF + 8


def test_one_slow_reading_of_the_cheap_step_does_not_keep_a_losing_head_drafting():
    """The first cheap step ran beside something else (50 ms); plain steps take 10 ms and a drafted step that gets
    nothing accepted 15 ms. Rechecks bring the estimate back and the gate closes."""
    gate = DraftGate(GatePool())
    readings = iter([0.050])
    drafted = []
    for _ in range(200):
        full = gate.decide(verify)
        drafted.append(full)
        if full:
            gate.observe(True, 1, 1, 0.002, verify, step_seconds=0.015)
        else:
            gate.observe(False, 1, 0, 0.0, verify, step_seconds=next(readings, 0.010))
    assert sum(drafted[:40]) > 20  # the slow reading opened it
    assert sum(drafted[100:]) <= 2 * PROBE_STEPS


def test_a_gate_sharing_its_request_times_the_catch_up_too():
    """Beside another gate of the same request (Proposer.situation), the head's catch-up on the steps the other
    gate's kind skipped is part of every drafted step of this kind: learnt from the first drafted step on."""
    gate = DraftGate(GatePool(), times_catch_up=True)
    gate.decide(verify)
    gate.observe(True, 2, 4, 0.006, verify)
    assert gate.full.draft_seconds == 0.006


def test_each_kind_of_step_has_its_own_gate():
    """A lookup branch's steps with a chain (the chain is the cheap step) and without one (a plain step is) are
    gated apart: lookup chains that beat the merged tree close the head where they exist and not where only the
    head has something to draft."""
    from types import SimpleNamespace

    from specserve.speculative.policy.draft_gate import StepGates

    class Proposer:
        def __init__(self):
            self.chain = True

        def situation(self, tokens, max_len):
            return self.chain

    class Request:  # hashed by identity, as a Sequence
        proposer, context, params = Proposer(), [1, 2, 3], SimpleNamespace(reproducible=False)

        def draft_room(self, max_len):
            return max_len

    gates = StepGates()
    seq = Request()
    with_chain = gates.gate(seq, 4)
    run(with_chain, 100, accepted=0)  # the merged tree never beats the chain: closed
    seq.proposer.chain = False
    without = gates.gate(seq, 4)
    assert without is not with_chain and gates.step_gates[seq] is without and without.times_catch_up
    assert run(without, 20, accepted=3) == [True] * 20  # the head pays where there is no chain
    seq.proposer.chain = True
    assert gates.gate(seq, 4) is with_chain and not with_chain.decide(verify)
    assert set(gates.pools) == {True, False}
