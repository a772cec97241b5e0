"""Schedules are data: check every schedule against theory with the simulator."""

from __future__ import annotations

import itertools
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evtrain.errors import UsageError
from evtrain.schedule_names import Schedule
from evtrain.stages.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
    format_instructions,
)
from evtrain.stages.schedules import (
    build_schedule,
    chunk_place,
    max_in_flight,
    model_chunk,
)
from evtrain.stages.simulator import (
    DeadlockError,
    ScheduleError,
    bubble_fraction,
    simulate,
    simulate_programs,
)

SCHEDULES = ["gpipe", "1f1b"]
STAGES = range(1, 9)
MICROBATCHES = range(1, 33)


def programs(schedule: str, P: int, M: int, **kw: bool) -> list[list[Instruction]]:
    return [build_schedule(schedule, s, P, M, **kw) for s in range(P)]


def text(program: list[Instruction]) -> str:
    return format_instructions(program)


# --- exact programs, written out by hand -------------------------------------


def test_1f1b_two_stages_three_microbatches_exact() -> None:
    L, RA, F, SA, RG, B, SG = (
        LoadMicrobatch,
        RecvActivation,
        Forward,
        SendActivation,
        RecvGrad,
        Backward,
        SendGrad,
    )
    stage0 = [
        L(0), F(0), SA(0),                     # warm-up: P-0-1 = 1 forward
        L(1), F(1), SA(1), RG(0), B(0),        # steady: F1 B0
        L(2), F(2), SA(2), RG(1), B(1),        # steady: F2 B1
        RG(2), B(2),                           # cool-down
        OptimizerStep(),
    ]  # fmt: skip
    stage1 = [
        L(0), RA(0), F(0), B(0), SG(0),        # no warm-up on the last stage
        L(1), RA(1), F(1), B(1), SG(1),
        L(2), RA(2), F(2), B(2), SG(2),
        OptimizerStep(),
    ]  # fmt: skip
    assert build_schedule("1f1b", 0, 2, 3) == stage0
    assert build_schedule("1f1b", 1, 2, 3) == stage1


@pytest.mark.parametrize(
    ("schedule", "P", "M", "expected"),
    [
        ("gpipe", 1, 2, ["L0 F0 L1 F1 B0 B1 OPT"]),
        ("1f1b", 1, 2, ["L0 F0 B0 L1 F1 B1 OPT"]),
        (
            "gpipe",
            2,
            2,
            [
                "L0 F0 SA0 L1 F1 SA1 RG0 B0 RG1 B1 OPT",
                "L0 RA0 F0 L1 RA1 F1 B0 SG0 B1 SG1 OPT",
            ],
        ),
        (
            # M < P: the early stages only warm up and cool down.
            "1f1b",
            3,
            2,
            [
                "L0 F0 SA0 L1 F1 SA1 RG0 B0 RG1 B1 OPT",
                "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RG1 B1 SG1 OPT",
                "L0 RA0 F0 B0 SG0 L1 RA1 F1 B1 SG1 OPT",
            ],
        ),
        (
            "1f1b",
            3,
            4,
            [
                "L0 F0 SA0 L1 F1 SA1 L2 F2 SA2 RG0 B0 L3 F3 SA3 RG1 B1 RG2 B2 RG3 B3 OPT",
                "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RA2 F2 SA2 RG1 B1 SG1 RA3 F3 SA3 RG2 B2 SG2 "
                "RG3 B3 SG3 OPT",
                "L0 RA0 F0 B0 SG0 L1 RA1 F1 B1 SG1 L2 RA2 F2 B2 SG2 L3 RA3 F3 B3 SG3 OPT",
            ],
        ),
    ],
)
def test_known_programs(schedule: str, P: int, M: int, expected: list[str]) -> None:
    assert [text(p) for p in programs(schedule, P, M)] == expected


def test_schedule_names() -> None:
    expected = build_schedule("1f1b", 1, 3, 5)
    assert build_schedule(Schedule.ONE_F_ONE_B, 1, 3, 5) == expected
    assert build_schedule("1F1B", 1, 3, 5) == expected
    assert [s.value for s in Schedule] == ["gpipe", "1f1b", "zb", "interleaved", "zbv"]


def test_forward_only_program() -> None:
    progs = programs("1f1b", 3, 2, forward_only=True)
    assert [text(p) for p in progs] == [
        "L0 F0 SA0 L1 F1 SA1",
        "RA0 F0 SA0 RA1 F1 SA1",
        "L0 RA0 F0 L1 RA1 F1",
    ]
    result = simulate_programs(progs, 2)
    assert all(len(t) == 2 and {sp.kind for sp in t} == {"forward"} for t in result.timelines)
    assert result.makespan == 4  # M + P - 1 forwards of cost 1


# --- structure and simulation over the whole grid -----------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("P", STAGES)
def test_program_structure(schedule: str, P: int) -> None:
    for M, s in itertools.product(MICROBATCHES, range(P)):
        prog = build_schedule(schedule, s, P, M)
        first, last = s == 0, s == P - 1
        kinds = Counter(type(ins) for ins in prog)
        assert kinds[Forward] == kinds[Backward] == M
        assert kinds[LoadMicrobatch] == (M if first or last else 0)
        assert kinds[RecvActivation] == kinds[SendGrad] == (0 if first else M)
        assert kinds[SendActivation] == kinds[RecvGrad] == (0 if last else M)
        assert kinds[ReduceGrads] == 0
        assert prog[-1] == OptimizerStep() and kinds[OptimizerStep] == 1
        # Each stage visits microbatches in order: FIFO channels then match.
        assert [i.microbatch for i in prog if isinstance(i, Forward)] == list(range(M))
        assert [i.microbatch for i in prog if isinstance(i, Backward)] == list(range(M))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("P", STAGES)
def test_simulation_matches_theory(schedule: str, P: int) -> None:
    for M in MICROBATCHES:
        result = simulate(schedule, P, M)  # raises on deadlock or misordering
        assert result.peak_in_flight == tuple(max_in_flight(schedule, s, P, M) for s in range(P))
        if schedule == "1f1b":
            assert result.peak_in_flight == tuple(min(P - s, M) for s in range(P))
        else:
            assert result.peak_in_flight == (M,) * P
        assert result.makespan == 2 * (M + P - 1)
        assert result.bubble_fraction == pytest.approx((P - 1) / (M + P - 1))
        assert result.bubble_fraction == pytest.approx(bubble_fraction(P, M))
        assert result.stage_idle_fraction == pytest.approx([bubble_fraction(P, M)] * P)
        check_timelines(result.timelines, M)


def check_timelines(timelines, M: int) -> None:
    """Independent of the simulator's own checks: each stage computes every
    microbatch's forward and backward (or I and W) once, in that order, with no
    overlap; forward goes down the pipe, backward (I) comes back up."""
    where = []
    for spans in timelines:
        kinds = ["backward", "forward"] + (["weight"] if spans[-1].kind == "weight" else [])
        assert sorted((sp.kind, sp.microbatch) for sp in spans) == sorted(
            itertools.product(kinds, range(M))
        )
        assert all(a.end <= b.start for a, b in itertools.pairwise(spans))
        at = {(sp.kind, sp.microbatch): sp for sp in spans}
        assert all(at["forward", m].end <= at["backward", m].start for m in range(M))
        if "weight" in kinds:
            assert all(at["backward", m].end <= at["weight", m].start for m in range(M))
        where.append(at)
    for s, m in itertools.product(range(len(timelines) - 1), range(M)):
        assert where[s]["forward", m].end <= where[s + 1]["forward", m].start
        assert where[s + 1]["backward", m].end <= where[s]["backward", m].start


@settings(max_examples=150, deadline=None)
@given(
    schedule=st.sampled_from(SCHEDULES),
    P=st.integers(1, 8),
    M=st.integers(1, 32),
    f=st.floats(0.1, 5.0),
    b=st.floats(0.1, 5.0),
)
def test_uneven_costs(schedule: str, P: int, M: int, f: float, b: float) -> None:
    """With equal per-stage costs the step is (M+P-1)(f+b) for any f, b."""
    result = simulate(schedule, P, M, forward_cost=f, backward_cost=b)
    assert result.makespan == pytest.approx((M + P - 1) * (f + b))
    assert result.busy == pytest.approx([M * (f + b)] * P)
    check_timelines(result.timelines, M)


# --- zero bubble (ZB-H1) --------------------------------------------------------


def test_zero_bubble_programs_exact() -> None:
    """Stage r's W's trail its I's by r microbatches: the last stage defers the most."""
    assert [text(p) for p in programs("zb", 2, 4)] == [
        "L0 F0 SA0 L1 F1 SA1 RG0 I0 W0 L2 F2 SA2 RG1 I1 W1 L3 F3 SA3 RG2 I2 W2 RG3 I3 W3 OPT",
        "L0 RA0 F0 I0 SG0 L1 RA1 F1 I1 SG1 W0 L2 RA2 F2 I2 SG2 W1 L3 RA3 F3 I3 SG3 W2 W3 OPT",
    ]
    assert text(build_schedule("zb", 1, 3, 3)) == (
        "RA0 F0 SA0 RA1 F1 SA1 RG0 I0 SG0 RA2 F2 SA2 RG1 I1 SG1 W0 RG2 I2 SG2 W1 W2 OPT"
    )


@pytest.mark.parametrize("P", STAGES)
def test_zero_bubble_structure(P: int) -> None:
    for M, s in itertools.product(MICROBATCHES, range(P)):
        prog = build_schedule("zb", s, P, M)
        kinds = Counter(type(ins) for ins in prog)
        assert kinds[Forward] == kinds[BackwardInput] == kinds[BackwardWeight] == M
        assert kinds[Backward] == 0
        where = {ins: i for i, ins in enumerate(prog)}
        for m in range(M):
            assert where[BackwardInput(m)] < where[BackwardWeight(m)]
            if s > 0:  # the gradient goes upstream right after I, before any W
                assert where[SendGrad(m)] == where[BackwardInput(m)] + 1
            if m + s < M:  # W of m waits for the I of m + stage
                assert where[BackwardWeight(m)] > where[BackwardInput(m + s)]
        assert [i.microbatch for i in prog if isinstance(i, BackwardWeight)] == list(range(M))
        assert [i for i in prog if not isinstance(i, BackwardWeight)] == [
            BackwardInput(i.microbatch) if isinstance(i, Backward) else i
            for i in build_schedule("1f1b", s, P, M)
        ], "zero bubble is 1F1B with B split and the W's placed after"


@pytest.mark.parametrize("P", STAGES)
def test_zero_bubble_simulation_matches_theory(P: int) -> None:
    """F = I = W = 1: idle time per stage (P-1)(F + I - W), a third of 1F1B's (P-1)(F + B)."""
    for M in MICROBATCHES:
        zb = simulate("zb", P, M, forward_cost=1, backward_cost=2, weight_cost=1)
        one = simulate("1f1b", P, M, forward_cost=1, backward_cost=2)
        assert zb.peak_in_flight == tuple(max_in_flight("zb", s, P, M) for s in range(P))
        assert zb.peak_in_flight == (min(P, M),) * P  # 1F1B's peak, on every stage
        assert max(zb.peak_in_flight) == max(one.peak_in_flight)
        assert zb.busy == one.busy == (3 * M,) * P
        assert zb.makespan <= one.makespan
        if M >= P:
            assert zb.makespan == 3 * M + (P - 1)
            assert zb.bubble_fraction == pytest.approx(bubble_fraction(P, M, "zb"))
            assert zb.makespan - 3 * M == (one.makespan - 3 * M) / 3
        check_timelines(zb.timelines, M)


@settings(max_examples=150, deadline=None)
@given(
    P=st.integers(1, 8),
    M=st.integers(1, 32),
    f=st.floats(0.1, 5.0),
    b=st.floats(0.1, 5.0),
    share=st.floats(0.0, 1.0),
    lookahead=st.integers(0, 2),
)
def test_zero_bubble_never_loses_to_1f1b(
    P: int, M: int, f: float, b: float, share: float, lookahead: int
) -> None:
    w = b * share
    zb = simulate("zb", P, M, forward_cost=f, backward_cost=b, weight_cost=w, lookahead=lookahead)
    one = simulate("1f1b", P, M, forward_cost=f, backward_cost=b)
    assert zb.makespan <= one.makespan + 1e-9
    assert zb.busy == pytest.approx([M * (f + b)] * P)
    if M >= P and lookahead == 0 and w <= min(f, b - w):
        # The paper's ZB-H1 bubble, (P - 1)(T_F + T_B - T_W) with T_B the I half,
        # where W fits in the gaps it fills (no longer than F or I).
        assert zb.makespan == pytest.approx(M * (f + b) + (P - 1) * (f + (b - w) - w))
    check_timelines(zb.timelines, M)


@pytest.mark.parametrize(
    ("stage", "edit", "message"),
    [
        (1, lambda p: p.insert(p.index(BackwardInput(0)), BackwardWeight(0)), "before the input"),
        (0, lambda p: p.insert(p.index(BackwardInput(0)), BackwardWeight(0)), "before the input"),
        (1, lambda p: p.remove(BackwardWeight(1)), "optimizer step must come once"),
        (1, lambda p: p.insert(-1, BackwardWeight(1)), "backwards the microbatch twice"),
        (1, lambda p: p.insert(-1, BackwardInput(1)), "backwards the microbatch twice"),
        (1, lambda p: p.insert(p.index(SendGrad(1)) + 1, Backward(1)), "twice"),
    ],
)
def test_zero_bubble_mistakes(stage: int, edit, message: str) -> None:
    progs = programs("zb", 2, 2)
    edit(progs[stage])
    with pytest.raises(ScheduleError, match=message):
        simulate_programs(progs, 2)


def test_weight_cost_is_part_of_the_backward() -> None:
    with pytest.raises(UsageError, match="weight_cost"):
        simulate("zb", 2, 2, backward_cost=1.0, weight_cost=1.5)
    with pytest.raises(UsageError, match="weight_cost must be a finite number"):
        simulate("zb", 2, 2, weight_cost=float("nan"))


# --- interleaved 1F1B (virtual stages) -------------------------------------------


def interleaved(P: int, M: int, V: int, **kw: int) -> list[list[Instruction]]:
    return [build_schedule("interleaved", s, P, M, virtual_stages=V, **kw) for s in range(P)]


def test_interleaved_programs_exact() -> None:
    """Megatron's order: chunk by chunk in rounds of P microbatches, depth first."""
    assert [text(p) for p in interleaved(2, 2, 2)] == [
        "L0 F0 SA0 L1 F1 SA1 RA0@1 F0@1 SA0@1 RA1@1 F1@1 SA1@1 RG0@1 B0@1 SG0@1 RG1@1 B1@1 "
        "SG1@1 RG0 B0 RG1 B1 OPT",
        "RA0 F0 SA0 RA1 F1 SA1 L0@1 RA0@1 F0@1 B0@1 SG0@1 L1@1 RA1@1 F1@1 B1@1 SG1@1 RG0 B0 "
        "SG0 RG1 B1 SG1 OPT",
    ]


@pytest.mark.parametrize("P", range(2, 7))
@pytest.mark.parametrize("V", [2, 3, 4])
def test_interleaved_simulation_matches_theory(P: int, V: int) -> None:
    """F = 1, B = 2: 1F1B's idle time divided by V; peak memory one chunk's
    activation per warm-up forward, plus one."""
    for M in [m for m in MICROBATCHES if m % max(1, m // P) == 0]:
        for lookahead in (0, 1):
            result = simulate_programs(interleaved(P, M, V, lookahead=lookahead), M, 1, 2)
            assert result.peak_in_flight == tuple(
                max_in_flight("interleaved", s, P, M, virtual_stages=V, lookahead=lookahead)
                for s in range(P)
            )
            assert result.busy == (3 * M * V,) * P  # each chunk is 1/V of a stage: unit costs
            if M >= P:
                one = simulate("1f1b", P, M, forward_cost=V, backward_cost=2 * V)
                idle = result.makespan - 3 * M * V
                assert idle == pytest.approx((one.makespan - 3 * M * V) / V)
                assert result.bubble_fraction == pytest.approx(
                    bubble_fraction(P, M, "interleaved", V)
                )
            check_chunk_timelines(result.timelines, P, M, V)


def check_chunk_timelines(timelines, P: int, M: int, V: int) -> None:
    """Every (chunk, microbatch) forward and backward once per stage; forwards go
    down the model's chunks, backwards come back up, across the ring."""
    at = {}
    for s, spans in enumerate(timelines):
        assert sorted((sp.kind, sp.chunk, sp.microbatch) for sp in spans) == sorted(
            itertools.product(["backward", "forward"], range(V), range(M))
        )
        assert all(a.end <= b.start for a, b in itertools.pairwise(spans))
        at.update({(sp.kind, sp.chunk * P + s, sp.microbatch): sp for sp in spans})
    for c, m in itertools.product(range(P * V - 1), range(M)):
        assert at["forward", c, m].end <= at["forward", c + 1, m].start
        assert at["backward", c + 1, m].end <= at["backward", c, m].start
    assert all(
        at["forward", P * V - 1, m].end <= at["backward", P * V - 1, m].start for m in range(M)
    )


def test_interleaved_forward_only_goes_chunk_by_chunk() -> None:
    progs = [
        build_schedule("interleaved", s, 2, 3, virtual_stages=2, forward_only=True)
        for s in range(2)
    ]
    assert (
        text(progs[0])
        == "L0 F0 SA0 L1 F1 SA1 L2 F2 SA2 RA0@1 F0@1 SA0@1 RA1@1 F1@1 SA1@1 RA2@1 F2@1 SA2@1"
    )
    result = simulate_programs(progs, 3)
    assert result.makespan == 2 * 3 + 2 - 1  # V * M forwards per stage, P - 1 to fill


@pytest.mark.parametrize(
    ("schedule", "P", "M", "V", "message"),
    [
        ("interleaved", 2, 4, 1, "virtual_stages >= 2"),
        ("interleaved", 1, 4, 2, "stages >= 2"),
        ("1f1b", 2, 4, 2, "needs schedule 'interleaved'"),
        ("interleaved", 4, 9, 2, "must be a multiple of 2"),
        ("interleaved", 2, 4, 0, "virtual_stages must be an integer >= 1"),
    ],
)
def test_virtual_stages_are_checked(schedule: str, P: int, M: int, V: int, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_schedule(schedule, 0, P, M, virtual_stages=V)
    # Rounds of P microbatches, or one round of all of them when M < 2P.
    for M in (3, 6, 8, 10):
        simulate_programs(interleaved(4, M, 2), M)


def test_dropping_any_interleaved_instruction_is_caught() -> None:
    progs = interleaved(2, 2, 2)
    for s, k in [(s, k) for s, prog in enumerate(progs) for k in range(len(prog))]:
        broken = [list(p) for p in progs]
        dropped = broken[s].pop(k)
        with pytest.raises(ScheduleError):
            simulate_programs(broken, 2)
            pytest.fail(f"dropping {dropped} on stage {s} went unnoticed")


def test_swapping_chunks_is_caught() -> None:
    progs = interleaved(2, 2, 2)
    # Stage 1 sends chunk 1's gradient to the previous stage's chunk: swap two chunks' blocks.
    i, j = progs[1].index(RecvActivation(0)), progs[1].index(RecvActivation(0, 1))
    progs[1][i], progs[1][j] = progs[1][j], progs[1][i]
    with pytest.raises(ScheduleError):
        simulate_programs(progs, 2)


# --- zero bubble in a V (zbv) -----------------------------------------------------


def zbv(P: int, M: int) -> list[list[Instruction]]:
    return [build_schedule("zbv", s, P, M, virtual_stages=2) for s in range(P)]


def torch_zbv_order(P: int, M: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's ScheduleZBVZeroBubble order for ``rank`` as (F/I/W, model chunk, microbatch)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    plan = SimpleNamespace(pp_group_size=P, num_stages=2 * P, _n_microbatches=M)
    actions = ScheduleZBVZeroBubble._calculate_single_rank_operations(plan, rank)  # type: ignore[arg-type]
    return [
        (a.computation_type.value, a.stage_index, a.microbatch_index)
        for a in actions
        if a is not None
    ]


@pytest.mark.parametrize(("P", "M"), [(2, 1), (2, 4), (2, 8), (3, 5), (4, 3), (4, 8), (5, 16)])
def test_zbv_computes_in_torchs_order(P: int, M: int) -> None:
    """Stage s runs what torch's rank P - 1 - s runs, in the same order: the V
    turned around so that the loss stays on the last stage."""
    for s, program in enumerate(zbv(P, M)):
        ours = [
            (code, model_chunk("zbv", s, P, ins.chunk), ins.microbatch)
            for ins in program
            for code in [{Forward: "F", BackwardInput: "I", BackwardWeight: "W"}.get(type(ins))]
            if code is not None
        ]
        assert ours == torch_zbv_order(P, M, P - 1 - s)


def test_zbv_places_the_chunks_in_a_v() -> None:
    """Stage s holds chunks P-1-s and P+s; the last stage reads the data and the
    targets; only stage 0 hands a chunk's output to its own other chunk."""
    P = 3
    assert [[model_chunk("zbv", s, P, v) for v in (0, 1)] for s in range(P)] == [
        [2, 3],
        [1, 4],
        [0, 5],
    ]
    assert [chunk_place("zbv", P, c) for c in range(2 * P)] == [
        (2, 0), (1, 0), (0, 0), (0, 1), (1, 1), (2, 1)
    ]  # fmt: skip
    progs = zbv(P, 4)
    loads = [{(i.chunk, i.microbatch) for i in p if isinstance(i, LoadMicrobatch)} for p in progs]
    assert loads[:2] == [set(), set()]
    assert loads[2] == {(v, m) for v in (0, 1) for m in range(4)}
    # Stage 0: chunk 0 sends to, and receives the gradient from, its own chunk 1.
    assert text(progs[0][:3]) == "RA0 F0 SA0"
    assert RecvActivation(0, 1) in progs[0] and SendGrad(0, 1) in progs[0]
    assert RecvGrad(0, 0) in progs[0]
    assert not any(isinstance(i, LoadMicrobatch) for i in progs[0])


@pytest.mark.parametrize("P", range(2, 8))
def test_zbv_simulation_matches_theory(P: int) -> None:
    """F = 1, B = 2 per stage (each chunk half of that), I = W: no deadlock at
    any M; from M = 2P - 1 on the idle time is (P - 1) chunk forwards, a sixth of
    1F1B's, and every stage holds at most 2P chunk activations (1F1B's peak)."""
    for M in MICROBATCHES:
        result = simulate_programs(zbv(P, M), M, 0.5, 1.0, schedule="zbv")
        assert result.busy == (3 * M,) * P
        assert result.peak_in_flight == tuple(
            max_in_flight("zbv", s, P, M, virtual_stages=2) for s in range(P)
        )
        assert max(result.peak_in_flight) <= 2 * P
        assert result.bubble_fraction == pytest.approx(bubble_fraction(P, M, "zbv"))
        assert result.makespan <= simulate("zb", P, M, 1, 2).makespan
        if M >= 2 * P - 1:
            one = simulate("1f1b", P, M, 1, 2)
            assert result.makespan - 3 * M == pytest.approx((one.makespan - 3 * M) / 6)
            assert result.peak_in_flight == (2 * P,) * P


def test_zbv_needs_two_chunks_on_two_stages_or_more() -> None:
    for P, V in [(2, 1), (2, 3), (1, 2)]:
        with pytest.raises(UsageError, match="virtual_stages=2 and stages >= 2"):
            build_schedule("zbv", 0, P, 4, virtual_stages=V)


@pytest.mark.parametrize(("P", "M"), [(2, 3), (3, 5)])
def test_dropping_any_zbv_instruction_is_caught(P: int, M: int) -> None:
    progs = zbv(P, M)
    for s, k in [(s, k) for s, prog in enumerate(progs) for k in range(len(prog))]:
        broken = [list(p) for p in progs]
        dropped = broken[s].pop(k)
        with pytest.raises(ScheduleError):
            simulate_programs(broken, M, schedule="zbv")
            pytest.fail(f"dropping {dropped} on stage {s} went unnoticed")


def test_zbv_forward_only_runs_down_then_up() -> None:
    progs = [build_schedule("zbv", s, 2, 2, virtual_stages=2, forward_only=True) for s in (0, 1)]
    assert text(progs[1]) == "L0 F0 SA0 L1 F1 SA1 L0@1 RA0@1 F0@1 L1@1 RA1@1 F1@1"
    assert text(progs[0]) == "RA0 F0 SA0 RA1 F1 SA1 RA0@1 F0@1 SA0@1 RA1@1 F1@1 SA1@1"
    simulate_programs(progs, 2, schedule="zbv")


# --- the checker catches broken schedules -------------------------------------


def test_recv_grad_before_send_deadlocks() -> None:
    progs = programs("1f1b", 2, 3)
    # Stage 0 waits for microbatch 0's gradient before sending its activation.
    assert text(progs[0][:4]) == "L0 F0 SA0 L1"
    progs[0].insert(2, progs[0].pop(progs[0].index(RecvGrad(0))))
    with pytest.raises(DeadlockError) as err:
        simulate_programs(progs, 3)
    assert err.value.stuck == {0: RecvGrad(0), 1: RecvActivation(0)}
    assert "stage 0 waits at RG0" in str(err.value)
    assert "stage 1 waits at RA0" in str(err.value)


def test_receive_out_of_order_is_caught() -> None:
    progs = programs("gpipe", 2, 2)
    i, j = progs[1].index(RecvActivation(0)), progs[1].index(RecvActivation(1))
    progs[1][i], progs[1][j] = progs[1][j], progs[1][i]
    with pytest.raises(ScheduleError, match="would receive the activation of microbatch 0"):
        simulate_programs(progs, 2)


@pytest.mark.parametrize("schedule", [*SCHEDULES, "zb"])
@pytest.mark.parametrize(("P", "M"), [(1, 2), (2, 3), (3, 2), (4, 5)])
def test_dropping_any_instruction_is_caught(schedule: str, P: int, M: int) -> None:
    progs = programs(schedule, P, M)
    for s, k in [(s, k) for s, prog in enumerate(progs) for k in range(len(prog))]:
        broken = [list(p) for p in progs]
        dropped = broken[s].pop(k)
        with pytest.raises(ScheduleError):
            simulate_programs(broken, M)
            pytest.fail(f"dropping {dropped} on stage {s} went unnoticed")


@pytest.mark.parametrize(
    ("stage", "edit", "message"),
    [
        (0, lambda p: p.insert(0, RecvActivation(0)), "first stage has no previous"),
        (0, lambda p: p.remove(LoadMicrobatch(0)), "forward before LoadMicrobatch"),
        (1, lambda p: p.insert(0, Backward(0)), "backward before its forward"),
        (1, lambda p: p.insert(-1, Forward(1)), "forwards the microbatch twice"),
        (1, lambda p: p.insert(0, OptimizerStep()), "optimizer step must come once"),
        (0, lambda p: p.append(Forward(7)), "microbatch outside 0..1"),
        (1, lambda p: p.remove(SendGrad(1)), "waits at RG1"),
        (0, lambda p: p.append(SendActivation(1)), "never receives the activations"),
    ],
)
def test_specific_mistakes(stage: int, edit, message: str) -> None:
    progs = programs("1f1b", 2, 2)
    edit(progs[stage])
    with pytest.raises(ScheduleError, match=message):
        simulate_programs(progs, 2)


@pytest.mark.parametrize("P", range(2, 6))
def test_waiting_on_each_send_deadlocks_1f1b_but_not_gpipe(P: int) -> None:
    """Why the executor must not wait on a send before the next receive."""
    for M in (2, 3, 8):
        with pytest.raises(DeadlockError):
            simulate("1f1b", P, M, rendezvous_sends=True)
        result = simulate("gpipe", P, M, rendezvous_sends=True)
        assert result.makespan == 2 * (M + P - 1)


# --- instructions as data, and bad input --------------------------------------


def test_instructions_print_compactly_and_roundtrip() -> None:
    prog = [*build_schedule("1f1b", 1, 3, 2), ReduceGrads()]
    assert text(prog) == "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RG1 B1 SG1 OPT RED"
    assert repr(Forward(3)) == "F3" and str(LoadMicrobatch(3)) == "L3"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(prog), type=list[Instruction]) == prog
    assert len(set(prog)) == len(prog)  # frozen structs hash by value
    with pytest.raises(AttributeError):
        prog[1].microbatch = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("x", 0, 2, 2), "unknown schedule 'x'; choose one of: gpipe, 1f1b, zb, interleaved"),
        (("1f1b", 0, 0, 2), "num_stages must be an integer >= 1, got 0"),
        (("gpipe", 0, 2, 0), "num_microbatches must be an integer >= 1, got 0"),
        (("1f1b", 2, 2, 2), r"stage must be in 0..1, got 2"),
        (("1f1b", -1, 2, 2), r"stage must be in 0..1, got -1"),
        (("1f1b", 0, True, 2), "num_stages must be an integer"),
        (("1f1b", 0, 2, 2.0), "num_microbatches must be an integer"),
    ],
)
def test_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(UsageError) as err:
        build_schedule(*args)
    assert message in str(err.value)
    with pytest.raises(UsageError):
        max_in_flight(*args)


def test_bad_simulation_input() -> None:
    with pytest.raises(UsageError, match="unknown schedule"):
        simulate("pipedream", 2, 2)
    with pytest.raises(UsageError, match="backward_cost must be a finite number >= 0"):
        simulate("1f1b", 2, 2, backward_cost=-1.0)
    with pytest.raises(UsageError, match="num_microbatches"):
        bubble_fraction(2, 0)


# --- data parallelism: the gradient reduction --------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize(("P", "M"), [(1, 3), (2, 4), (4, 8)])
def test_reduce_grads_comes_after_the_last_backward(schedule: str, P: int, M: int) -> None:
    for stage in range(P):
        prog = build_schedule(schedule, stage, P, M, reduce_grads=True)
        assert prog[-2:] == [ReduceGrads(), OptimizerStep()]
        assert Counter(type(i) for i in prog)[ReduceGrads] == 1
        last_backward = max(
            i for i, ins in enumerate(prog) if isinstance(ins, Backward | BackwardWeight)
        )
        assert prog.index(ReduceGrads()) > last_backward
        # Without it, the same program minus the reduction.
        assert [i for i in prog if i != ReduceGrads()] == build_schedule(schedule, stage, P, M)


def test_simulated_reduction_adds_its_cost_after_the_pipeline_drains() -> None:
    P, M = 3, 6
    plain = simulate("1f1b", P, M)
    reduced = simulate("1f1b", P, M, reduce_grads=True, reduce_cost=0.5)
    assert reduced.makespan == plain.makespan + 0.5
    for stage, timeline in enumerate(reduced.timelines):
        spans = [s for s in timeline if s.kind == "reduce"]
        assert len(spans) == 1 and spans[0].microbatch == -1
        assert spans[0].start >= max(s.end for s in timeline if s.kind == "backward"), stage
    # The reduction is communication, not compute: the bubble grows.
    assert reduced.bubble_fraction > plain.bubble_fraction


def test_simulator_rejects_a_reduction_before_the_last_backward() -> None:
    programs = [build_schedule("gpipe", s, 2, 2, reduce_grads=True) for s in range(2)]
    early = list(programs[1])
    early.remove(ReduceGrads())
    early.insert(early.index(Backward(1)), ReduceGrads())
    with pytest.raises(ScheduleError, match="reduced once, after all M backwards"):
        simulate_programs([programs[0], early], 2)
