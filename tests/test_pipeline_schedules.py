"""Pipeline schedules as data: the simulator reproduces the report's bubble table and the checker
catches broken action lists.

Cost convention: ``Costs.b`` is the input-gradient backward, the table's B is the *full* backward
b + w. The table's cost model (formulas exact): F=2, b=2 (B=3), W=1, F&B = F + B = 5, no latency.
"""
import hashlib
import json
import struct
from pathlib import Path

import pytest

from parallel.pipeline.schedules import SCHEDULES, Action, Kind, Payload, get_schedule, p2p_streams
from parallel.pipeline.schedules.dualpipe import local_phases
from parallel.pipeline.simulator import Costs, ScheduleError, simulate, table_bubble

TABLE = Costs(f=2, b=2, w=1)  # F=2, B=3, W=1, F&B=5
MICROBATCHES = {4: (8, 12, 20), 8: (16, 20, 34), 16: (32, 48)}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("pp", [4, 8, 16])
def test_bubble_equals_table(name, pp):
    for n in MICROBATCHES[pp]:
        sim = simulate(get_schedule(name, pp, n), TABLE)
        assert sim.max_bubble == table_bubble(name, pp, TABLE), (name, pp, n, sim.bubble)
        assert sim.bubble[0] == sim.max_bubble == sim.makespan - sim.busy[0]


def test_dualpipev_odd_pp():
    for pp in (3, 5):
        sim = simulate(get_schedule("dualpipev", pp, 2 * pp + 1), TABLE)
        assert sim.max_bubble == table_bubble("dualpipev", pp, TABLE)


def test_table_values_pp8():
    assert [table_bubble(s, 8, TABLE) for s in ("1f1b", "zb1p", "dualpipe", "dualpipev")] == [35, 21, 15, 35]


@pytest.mark.parametrize("costs", [Costs(f=3, b=2, w=1), Costs(f=1, b=2, w=0.5), Costs(f=2, b=1, w=2)])
def test_1f1b_zb1p_bubble_for_other_costs(costs):
    for pp in (4, 8):
        assert simulate(get_schedule("1f1b", pp, 3 * pp), costs).max_bubble == (pp - 1) * (costs.f + costs.b + costs.w)
        assert simulate(get_schedule("zb1p", pp, 3 * pp), costs).max_bubble == table_bubble("zb1p", pp, costs)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("pp", [4, 8, 16])
def test_dualpipe_overlap_credit(name, pp):
    """With F&B < F + B the simulated bubble is below the table's by (PP/2-2)(F+B-F&B), PP = stages."""
    stages = pp if name == "dualpipe" else 2 * pp
    for fb in (4, 4.5):
        costs = Costs(f=2, b=2, w=1, fb=fb)
        sim = simulate(get_schedule(name, pp, 2 * pp + 4), costs)
        assert sim.max_bubble == table_bubble(name, pp, costs) - (stages / 2 - 2) * (2 + 3 - fb)


@pytest.mark.parametrize("pp", [4, 8, 16])
def test_peak_activations(pp):
    for name in ("1f1b", "zb1p"):
        sim = simulate(get_schedule(name, pp, 2 * pp + 2), TABLE)
        assert sim.peak_activations == [pp - r for r in range(pp)]
    assert simulate(get_schedule("dualpipe", pp, 2 * pp + 2), TABLE).peak_activations == [pp + 1] * pp
    # DualPipeV counts chunk activations: PP + 1 with PP = 2*pp stages of half the size
    assert simulate(get_schedule("dualpipev", pp, 2 * pp + 2), TABLE).peak_activations == [2 * pp + 1] * pp


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_is_valid(name):
    lat = Costs(f=2, b=2, w=1, fb=4, p2p=0.7)
    for pp in range(1, 9):
        for n in range(pp, 3 * pp + 3):
            try:
                schedule = get_schedule(name, pp, n)
            except ValueError:
                continue
            sim = simulate(schedule, lat)  # raises ScheduleError on any violation
            assert len(schedule) == pp and sim.makespan > 0
            for r, actions in enumerate(schedule):
                assert all(a.peer != r for a in actions if not a.is_compute)


def test_dualpipe_modules_and_directions():
    pp, n = 8, 20
    for r, actions in enumerate(get_schedule("dualpipe", pp, n)):
        for a in actions:
            for p in a.parts() if a.is_compute else ():
                assert p.stage == (r if p.chunk == 0 else pp - 1 - r)
                assert (p.mb < n // 2) == (p.chunk == 0)   # first half flows 0 -> pp-1 through chunk 0
    for r, actions in enumerate(get_schedule("dualpipev", 4, 8)):
        for a in actions:
            for p in a.parts() if a.is_compute else ():
                assert p.stage == (r if p.chunk == 0 else 2 * 4 - 1 - r)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_dualpipe_phase_counts(pp):
    H, n = pp // 2, 2 * pp
    for r in range(pp):
        h = min(r, pp - 1 - r)
        ops = local_phases(h, H, n, middle=h == H - 1)
        pairs = sum(op[0] == "FB" for op in ops)
        assert pairs == 2 * (n - pp + h + 1) - (h == H - 1) + (H - h - 1)
        assert sum(op[0] == "W" for op in ops) == 2 * H - h - 1  # zero-bubble Bs: nB1W1F1 + half of nB1B0 + nWB0
        assert ops[: 2 * (H - h - 1)] == [("F", 0)] * (2 * (H - h - 1))  # nF0


@pytest.mark.parametrize("name, pp, n, message", [
    ("dualpipe", 3, 12, r"dualpipe: pp \(3\) must be even"),
    ("dualpipe", 4, 6, r"dualpipe: n_microbatches \(6\) must be >= 2\*pp \(8\)"),
    ("dualpipe", 4, 9, r"dualpipe: n_microbatches \(9\) must be even"),
    ("dualpipev", 4, 7, r"dualpipev: n_microbatches \(7\) must be >= 2\*pp \(8\)"),
    ("1f1b", 4, 3, r"1f1b: n_microbatches \(3\) must be >= pp \(4\)"),
    ("zb1p", 0, 3, r"zb1p: pp \(0\) must be >= 1"),
    ("gpipe", 4, 8, r"schedule \('gpipe'\) must be one of"),
])
def test_preconditions(name, pp, n, message):
    with pytest.raises(ValueError, match=message):
        get_schedule(name, pp, n)


def _without(schedule, rank, pred):
    out = [list(a) for a in schedule]
    i = next(i for i, a in enumerate(out[rank]) if pred(a))
    return out, out[rank].pop(i)


def test_checker_rejects_missing_send():
    # The first send 0 -> 1 missing: rank 1's first receive pairs with rank 0's next send (FIFO, as NCCL).
    broken, _ = _without(get_schedule("dualpipe", 4, 8), 0, lambda a: a.kind is Kind.SEND)
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(recv act mb0 s0 <- r0\): FIFO violation: this is "
                                            r"RECV #0 from rank 0, but rank 0's SEND #0 to rank 1 is act of micro-"
                                            r"batch 1 stage 0"):
        simulate(broken)
    # The last send 0 -> 1 missing: its receive waits for ever.
    schedule = [list(a) for a in get_schedule("dualpipe", 4, 8)]
    last = max(i for i, a in enumerate(schedule[0]) if a.kind is Kind.SEND and a.peer == 1)
    gone = schedule[0].pop(last)
    waits = rf"deadlock: no rank can make progress; waiting: .*rank 1 at action \d+ \(recv {gone.payload.value} " \
            rf"mb{gone.mb} s{gone.stage} <- r0\)"
    with pytest.raises(ScheduleError, match=waits):
        simulate(schedule)


def test_checker_rejects_missing_recv():
    broken, _ = _without(get_schedule("1f1b", 4, 4), 1, lambda a: a.kind is Kind.RECV)
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(F0.0\): F of micro-batch 0 stage 1 before its input"):
        simulate(broken)


def test_checker_rejects_backward_before_forward():
    broken = [list(a) for a in get_schedule("1f1b", 2, 2)]
    seq = broken[1]   # last rank: [recv, F0, BW0, send, recv, F1, BW1, send]
    i = next(i for i, a in enumerate(seq) if a.kind is Kind.F)
    seq[i], seq[i + 1] = seq[i + 1], seq[i]
    with pytest.raises(ScheduleError, match=r"backward of micro-batch 0 stage 1 before its F on this rank"):
        simulate(broken)


def test_checker_rejects_missing_w_and_duplicates():
    broken, w = _without(get_schedule("zb1p", 4, 4), 2, lambda a: a.kind is Kind.W)
    with pytest.raises(ScheduleError, match=rf"micro-batch {w.mb} stage 2 needs one F and one BW .*it has F, B"):
        simulate(broken)
    doubled = [list(a) for a in get_schedule("zb1p", 4, 4)]
    doubled[3].append(doubled[3][-1])
    with pytest.raises(ScheduleError, match=r"second W of micro-batch \d+ stage 3"):
        simulate(doubled)


def test_checker_rejects_missing_microbatch():
    schedule = get_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="micro-batch 2 stage 0 needs one F and one BW .*it has nothing"):
        simulate(schedule, n_microbatches=3)


def test_checker_rejects_unmatched_send_and_wrong_peer():
    extra = [list(a) for a in get_schedule("1f1b", 2, 2)]
    extra[0].append(Action(Kind.SEND, 1, 0, 0, 1, Payload.ACT))
    with pytest.raises(ScheduleError, match="posted twice"):
        simulate(extra)
    stray = [list(a) for a in get_schedule("1f1b", 2, 2)]
    stray[1].append(Action(Kind.SEND, 0, 1, 0, 0, Payload.ACT))
    with pytest.raises(ScheduleError, match="SEND of act of micro-batch 0 stage 1 from rank 1 to rank 0 has no "
                                            "matching RECV"):
        simulate(stray)
    wrong = [list(a) for a in get_schedule("1f1b", 3, 3)]
    i = next(i for i, a in enumerate(wrong[0]) if a.kind is Kind.SEND)
    a = wrong[0][i]
    wrong[0][i] = Action(a.kind, a.mb, a.stage, a.chunk, 2, a.payload)
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 .*FIFO violation"):
        simulate(wrong)


def test_action_validation_and_str():
    with pytest.raises(ValueError, match="peer and payload"):
        Action(Kind.SEND, 0, 0)
    with pytest.raises(ValueError, match="bwd is required"):
        Action(Kind.FB, 0, 0)
    pair = next(a for a in get_schedule("dualpipe", 4, 8)[0] if a.kind is Kind.FB)
    assert str(pair) == "F3.0&B5.1" and [p.kind for p in pair.parts()] == [Kind.F, Kind.BW]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_tool_writes_png(name, tmp_path, capsys):
    from tools.schedule import main

    out = tmp_path / f"{name}.png"
    assert main(["--schedule", name, "--pp", "4", "--microbatches", "10", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = struct.unpack(">II", data[16:24])
    assert width > 600 and height > 200
    text = capsys.readouterr().out
    formula = table_bubble(name, 4, TABLE)
    assert f"bubble (max over ranks) {formula:g}; table formula {formula:g}" in text


def test_tool_reports_bad_arguments(capsys):
    from tools.schedule import main

    assert main(["--schedule", "dualpipe", "--pp", "3", "--microbatches", "12"]) == 2
    assert "error: dualpipe: pp (3) must be even" in capsys.readouterr().err


# ---- FIFO-consistent point-to-point (NCCL pairs sends and receives in issue order, ignoring tags) ----
def _min_microbatches(name: str, pp: int) -> int:
    return 2 * pp if name in ("dualpipe", "dualpipev") else pp


def _fifo_cases():
    for name in sorted(SCHEDULES):
        for pp in range(2, 17):
            if name == "dualpipe" and pp % 2:
                continue
            m = _min_microbatches(name, pp)
            for n in sorted({m, m + 1, m + 2, 20, 40}):
                if n >= m and not (name == "dualpipe" and n % 2):
                    yield name, pp, n


def test_every_rank_pair_is_fifo_consistent():
    """Every schedule, pp 2..16, n in {min, min+1/+2, 20, 40}: the k-th SEND a -> b carries what the k-th RECV
    b <- a expects, and the simulator accepts the list."""
    checked = set()
    for name, pp, n in _fifo_cases():
        schedule = get_schedule(name, pp, n)
        streams = p2p_streams(schedule)
        assert streams, (name, pp, n)
        for (a, b), (sends, recvs) in streams.items():
            got = [(x.payload, x.mb, x.stage) for x in recvs]
            want = [(x.payload, x.mb, x.stage) for x in sends]
            assert got == want, f"{name} pp={pp} n={n}: r{a}->r{b} sends {want} but r{b} receives {got}"
        simulate(schedule, Costs(f=2, b=2, w=1, fb=4, p2p=0.5), n_microbatches=n)
        checked.add((name, pp, n))
    for name in SCHEDULES:   # the enumeration itself: every pp the schedule accepts, >= 3 batch counts each
        pps = {pp for s, pp, _ in checked if s == name}
        assert pps == (set(range(2, 17, 2)) if name == "dualpipe" else set(range(2, 17))), name
        assert all(len({n for s, p, n in checked if (s, p) == (name, pp)}) >= 3 for pp in pps), name


def test_compute_order_is_pinned():
    """Placing the transfers must never move compute: each rank's compute actions (SEND/RECV stripped) are
    pinned by digest, recorded from the schedules whose compute order matches DeepSeek's reference step()."""
    golden = json.loads((Path(__file__).parent / "assets" / "schedule_compute_order.json").read_text())
    for key, digest in golden.items():
        name, pp, n = key.split()
        schedule = get_schedule(name, int(pp), int(n))
        text = "\n".join(" ".join(str(a) for a in rank if a.is_compute) for rank in schedule)
        assert hashlib.sha256(text.encode()).hexdigest()[:16] == digest, key
    assert len(golden) > 300


def test_fifo_violation_is_rejected():
    """Two swapped receives of different payloads from one peer (each receive right before its consumer) are
    not FIFO: the checker names the rank and the pairing."""
    schedule = get_schedule("dualpipe", 8, 20)
    recvs = [i for i, a in enumerate(schedule[1]) if a.kind is Kind.RECV and a.peer == 0]
    i, j = next((i, j) for i, j in zip(recvs, recvs[1:]) if schedule[1][i].payload is not schedule[1][j].payload)
    swapped = [list(r) for r in schedule]
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match=r"rank 1, action \d+ \(recv .* <- r0\): FIFO violation: this is RECV #\d+ "
                                            r"from rank 0, but rank 0's SEND #\d+ to rank 1 is"):
        simulate(swapped)
