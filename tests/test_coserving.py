"""The co-serving benchmark's trace, SLO arithmetic and record (``benchmarks/_coserving.py``,
``benchmarks/bench_coserving.py report``), without engines."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from _coserving import (  # noqa: E402
    IdleModel,
    Outcome,
    TraceRow,
    attainment,
    build_trace,
    demand_peak,
    fit_idle,
    kv_bytes_per_token,
    kv_demand,
    load_trace,
    max_rate,
    meets_slo,
    memory_bound_rates,
    misses,
    prompt_ids,
    rate_grid,
    shared_misses,
    zipf_weights,
)

MODELS = ["m0", "m1", "m2"]


def test_committed_trace_is_the_azure_window() -> None:
    rows = load_trace()
    assert len(rows) == 1500 and rows[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:], strict=False))
    assert (rows[0].prompt_len, rows[0].output_len) == (374, 44)  # the trace's first request
    assert 1000 < sum(r.prompt_len for r in rows) / len(rows) < 1100  # mean context 1067 tokens


@pytest.mark.parametrize("rate", [2.0, 7.5, 20.0])
def test_trace_is_scaled_to_the_rate(rate: float) -> None:
    reqs = build_trace(MODELS, rate, 30.0, 1.5)
    assert len(reqs) == round(rate * 30)
    assert reqs[0].at_s == 0.0 and reqs[-1].at_s == pytest.approx(30.0, rel=1e-6)
    rows = load_trace()[: len(reqs)]
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(r.prompt_len, r.output_len) for r in rows]
    # bursts kept: inter-arrival gaps are the trace's, scaled by one factor
    gaps = [b.at_s - a.at_s for a, b in zip(reqs, reqs[1:], strict=False)]
    raw = [b.arrival_s - a.arrival_s for a, b in zip(rows, rows[1:], strict=False)]
    k = gaps[5] / raw[5]
    assert all(g == pytest.approx(k * r, abs=1e-9) for g, r in zip(gaps, raw, strict=True))


def test_skew_rotates_the_hot_model_and_uniform_is_even() -> None:
    reqs = build_trace(MODELS, 30.0, 45.0, 1.5)  # 1350 requests
    n = len(reqs)
    for third in range(3):
        part = Counter(r.model for r in reqs[third * n // 3:(third + 1) * n // 3])
        hot = MODELS[third]
        assert part.most_common(1)[0][0] == hot
        assert part[hot] / sum(part.values()) == pytest.approx(zipf_weights(3, 1.5)[0], abs=0.06)
    even = Counter(r.model for r in build_trace(MODELS, 30.0, 45.0, 0.0))
    assert all(abs(c / n - 1 / 3) < 0.05 for c in even.values())
    assert build_trace(MODELS, 5.0, 20.0, 1.5, seed=3) == build_trace(MODELS, 5.0, 20.0, 1.5, seed=3)
    assert build_trace(MODELS, 5.0, 20.0, 1.5, seed=3) != build_trace(MODELS, 5.0, 20.0, 1.5, seed=4)


def test_trace_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="1500"):
        build_trace(MODELS, 100.0, 60.0, 1.0)
    with pytest.raises(ValueError, match="> 0"):
        build_trace(MODELS, 0.0, 10.0, 1.0)
    with pytest.raises(ValueError, match="skew"):
        zipf_weights(3, -1)
    assert zipf_weights(3, 0) == [pytest.approx(1 / 3)] * 3
    assert sum(zipf_weights(3, 1.5)) == pytest.approx(1.0)


def test_prompt_ids_are_fixed_and_distinct() -> None:
    a, b = build_trace(MODELS, 2.0, 10.0, 1.0)[:2]
    assert prompt_ids(a) == prompt_ids(a) and len(prompt_ids(a)) == a.prompt_len
    assert prompt_ids(a)[:8] != prompt_ids(b)[:8]  # no shared prefix between requests
    assert all(3 <= t < 380 for t in prompt_ids(a, low=3, high=380))


def test_idle_fit_and_slo() -> None:
    samples = [(128, 0.020, 0.010), (1024, 0.060, 0.011), (4096, 0.200, 0.012), (1024, 0.062, 0.010)]
    idle = fit_idle(samples)
    assert idle.ttft_b == pytest.approx(4.4e-5, rel=0.1) and idle.tpot == pytest.approx(0.011)
    assert idle.ttft(1024) == pytest.approx(0.0605, rel=0.1)
    ok = Outcome(0, "m0", 1024, 10, 0.0, ttft_s=0.3, e2e_s=0.3 + 9 * 0.05, tokens=10)
    assert ok.tpot_s == pytest.approx(0.05)
    assert meets_slo(ok, idle, 5.0) and not meets_slo(ok, idle, 4.0)  # TTFT 0.3 s vs 5 x 0.06
    slow_tpot = Outcome(0, "m0", 1024, 10, 0.0, ttft_s=0.1, e2e_s=0.1 + 9 * 0.06, tokens=10)
    assert not meets_slo(slow_tpot, idle, 5.0)  # 60 ms > 5 x 11 ms
    failed = Outcome(0, "m0", 1024, 10, 0.0, error="HTTP 500")
    assert not meets_slo(failed, idle, 100.0)
    assert attainment([ok, slow_tpot, failed, ok], {"m0": idle}, 5.0) == 0.5
    with pytest.raises(ValueError, match="two"):
        fit_idle([(1, 0.1, 0.01)])


def test_misses_name_what_was_late_and_which_both_policies_missed() -> None:
    idle = {"m0": IdleModel(0.01, 0.0, 0.01)}  # SLO at k = 5: TTFT <= 50 ms, TPOT <= 50 ms

    def out(i: int, ttft: float | None, tpot: float, error: str | None = None) -> Outcome:
        return Outcome(i, "m0", 128, 11, 0.0, ttft_s=ttft, e2e_s=None if ttft is None else ttft + 10 * tpot,
                       tokens=11, error=error)

    elastic = [out(0, 0.01, 0.01), out(1, 0.2, 0.01), out(2, 0.01, 0.2), out(3, 0.2, 0.2), out(4, None, 0, "HTTP 500")]
    assert misses(elastic, idle, 5.0) == {1: "ttft", 2: "tpot", 3: "both", 4: "error"}
    assert misses(elastic, idle, 100.0) == {4: "error"}
    static = [out(0, 0.01, 0.01), out(1, 0.3, 0.01), out(2, 0.01, 0.01), out(3, 0.01, 0.3), out(4, 0.01, 0.01)]
    # static also missed requests 1 (late) and 3 (slow); it met 2 and 4
    assert shared_misses(misses(elastic, idle, 5.0), misses(static, idle, 5.0)) == (2, 2)
    assert shared_misses({}, misses(static, idle, 5.0)) == (0, 0)


def test_max_rate_needs_every_lower_rate() -> None:
    assert max_rate({1: 1.0, 2: 0.995, 4: 0.98, 8: 1.0}) == 2  # 8 meets it again, after a miss: not counted
    assert max_rate({1: 0.9, 2: 1.0}) is None
    assert max_rate({}) is None
    assert max_rate({1: float("nan")}) is None
    assert rate_grid(2, 10, 1.5) == [2, 3, 4.5, 6.75]


def test_memory_bound_rates_of_one_hot_model_at_a_time() -> None:
    """Evenly spaced requests held 0.95 s each, all to the hot model (skew 50): at rate r about r requests of 1010
    tokens are in flight, on one engine. A slice of 1.2 requests' KV holds rate 1, not 2; three slices shared hold
    rate 3, not 4: the elastic cache's 3x, as many slices as models."""
    rows = [TraceRow(float(i), 1000, 10) for i in range(400)]
    per_token = dict.fromkeys(MODELS, 1)
    static, elastic = memory_bound_rates(MODELS, per_token, 1212, [1, 2, 3, 4], 40.0, 50.0, ttft_s=0.05,
                                         tpot_s=0.09, rows=rows)
    assert (static, elastic) == (1, 3)
    # a slice three times as large holds rate 3 alone; one model alone gains nothing from sharing
    assert memory_bound_rates(MODELS, per_token, 3636, [1, 2, 3, 4], 40.0, 50.0, ttft_s=0.05, tpot_s=0.09,
                              rows=rows)[0] == 3
    assert memory_bound_rates(["m0"], per_token, 3636, [1, 2, 3, 4], 40.0, 0.0, ttft_s=0.05, tpot_s=0.09,
                              rows=rows) == (3, 3)
    with pytest.raises(ValueError, match="missing \\['m2'\\]"):
        memory_bound_rates(MODELS, {"m0": 1, "m1": 1}, 1212, [1], 40.0, 0.0, ttft_s=0.05, tpot_s=0.09, rows=rows)
    with pytest.raises(ValueError, match="slice must be > 0"):
        memory_bound_rates(MODELS, per_token, 0, [1], 40.0, 0.0, ttft_s=0.05, tpot_s=0.09, rows=rows)


def test_kv_demand_of_requests_in_flight() -> None:
    """A request needs its prompt's KV from its sending (waiting included), then one token more at a time from its
    first token to its last; failed requests and models without a figure are left out."""
    outs = [Outcome(0, "a", 100, 11, 0.0, ttft_s=1.0, e2e_s=2.0, tokens=11),
            Outcome(1, "b", 50, 1, 0.5, ttft_s=0.5, e2e_s=0.5, tokens=1),
            Outcome(2, "a", 999, 5, 0.0, error="HTTP 500"),
            Outcome(3, "unknown", 999, 5, 0.0, ttft_s=0.1, e2e_s=0.2, tokens=5)]
    curve = dict(kv_demand(outs, {"a": 10, "b": 2}, step=0.5))
    assert sorted(curve) == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert curve[0.0] == {"a": 1000, "b": 0}
    assert curve[0.5] == {"a": 1000, "b": 100}  # b sent: its prompt, before its first token
    assert curve[1.0] == {"a": 1010, "b": 102}  # a's first token; b's one token and its end
    assert curve[1.5] == {"a": 1060, "b": 0}  # halfway to its 11th
    assert curve[2.0] == {"a": 1110, "b": 0}
    assert demand_peak(list(curve.items())) == (1.0, {"a": 1010, "b": 102})  # 1112 in all, 1110 at 2.0
    assert kv_demand([], {"a": 1}) == [] and demand_peak([]) is None
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x K and V x 2 bytes; Llama-3.2-3B gives its head_dim
    assert kv_bytes_per_token({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                               "num_key_value_heads": 8}) == 128 << 10
    assert kv_bytes_per_token({"hidden_size": 3072, "num_attention_heads": 24, "head_dim": 128,
                               "num_hidden_layers": 28, "num_key_value_heads": 8}) == 112 << 10


def rate_run(rate: float, ttft: float) -> dict:
    """One rate's run file entry: 20 requests of model m0, each ``ttft`` late to its first token."""
    outs = [Outcome(i, "m0", 128, 10, i / rate, ttft_s=ttft, e2e_s=ttft + 0.09, tokens=10, chunks=10).as_dict()
            for i in range(20)]
    return {"skew": 1.5, "rate": rate, "wall_s": 20 / rate, "outcomes": outs, "preemptions": {"m0": 0.0},
            "mem": [[0.0, {"m0": 2 << 30}], [0.1, {"m0": 3 << 30}]]}


BASE = {"kv_bytes_each": 2 << 30, "models": ["m0"], "duration_s": 10,
        "idle": {"m0": [(128, 0.02, 0.01), (1024, 0.06, 0.01)]}, "meta": {"gpu": "test"}}


def test_report_from_two_policies(tmp_path: Path) -> None:
    import bench_coserving as bc

    static = {**BASE, "policy": "static", "runs": [rate_run(1, 0.05), rate_run(2, 0.05), rate_run(4, 5.0)]}
    kv = {**BASE, "policy": "kvcached", "runs": [rate_run(1, 0.05), rate_run(2, 0.05), rate_run(4, 0.05)]}
    (tmp_path / "coserving_static.json").write_text(json.dumps(static))
    (tmp_path / "coserving_kvcached.json").write_text(json.dumps(kv))
    md = tmp_path / "rec.md"
    bc.report([str(tmp_path)], md, "test")
    text = md.read_text()
    assert "static 2, kvcached 4 req/s; ratio **2.00**" in text
    assert "- skewed, k=10, a lower target: highest rate at >= 95 % attainment: static 2, kvcached 4 req/s; " \
        "ratio 2.00" in text
    # at rate 4 static was late on all 20 requests (5 s TTFT), kvcached on none
    assert "| skewed | 4 | 20 | 20 (20/0/0/0) | 0 (0/0/0/0) | 0 | 0 |" in text
    assert (tmp_path / "rec.png").stat().st_size > 0 and (tmp_path / "rec_memory.png").stat().st_size > 0
    assert isinstance(bc.summarize({"static": static})["idle"]["m0"], IdleModel)
    assert "KV memory the requests in flight needed" not in text  # no model of a known shape: no demand table
    hot, cold = "llama-3.2-3b", "llama-3-8b"
    outs = [Outcome(0, hot, 3000, 2, 0.0, ttft_s=1.0, e2e_s=2.0, tokens=2).as_dict(),
            Outcome(1, cold, 1000, 2, 0.0, ttft_s=1.0, e2e_s=2.0, tokens=2).as_dict()]
    known = {"kvcached": {**kv, "models": [cold, hot], "runs": [{"skew": 1.5, "rate": 3.0, "outcomes": outs}]}}
    rows = [ln for ln in bc._demand_lines(known) if ln.startswith("| kvcached")]
    share = 3002 * 112 / (3002 * 112 + 1002 * 128)  # the 3B's KV per token is 112 KiB, the 8B's 128 KiB
    assert len(rows) == 1 and f"| {hot} | {share:.2f} | {3 * share:.2f} |" in rows[0], rows


def test_a_policy_that_missed_at_every_rate_is_below_the_lowest() -> None:
    import bench_coserving as bc

    s = {"table": {"static": {1.5: {4.5: {}, 2.0: {}}}, "kvcached": {1.5: {4.5: {}}}}}
    assert bc._best_text(s, 1.5, {"static": None, "kvcached": 4.5}) == "static below 2.0, kvcached 4.5 req/s"
    assert bc._best_text(s, 0.0, {"static": None, "kvcached": None}) == "static not run, kvcached not run req/s"


FAKE_MPS = """#!/bin/sh
# records each call (its arguments, stdin and pipe directory) and answers as the MPS control program does
log="$CUDA_MPS_PIPE_DIRECTORY/calls"
if [ "$1" = "-d" ]; then echo "daemon $CUDA_MPS_LOG_DIRECTORY" >> "$log"; exit "${FAKE_MPS_RC:-0}"; fi
read -r cmd
echo "ask $cmd" >> "$log"
if [ "$cmd" = get_server_list ]; then cat "$CUDA_MPS_PIPE_DIRECTORY/servers" 2>/dev/null || true; fi
"""


def fake_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake control program first on PATH, and no daemon in the environment."""
    import os

    import bench_coserving as bc

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / bc.Mps.CONTROL
    fake.write_text(FAKE_MPS)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)


def test_mps_daemon_is_started_asked_and_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import bench_coserving as bc

    fake_mps(tmp_path, monkeypatch)
    work = tmp_path / "work"
    mps = bc.Mps(work)
    mps.start()
    pipe = work / "mps_pipe"
    # clients started from now on (the engines) find the daemon through the run's own directories
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and (work / "mps_log").is_dir()
    assert mps.servers() == []
    (pipe / "servers").write_text("4242\n")
    assert mps.servers() == ["4242"]
    mps.stop()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert (pipe / "calls").read_text().splitlines() == [
        f"daemon {work / 'mps_log'}", "ask get_server_list", "ask get_server_list", "ask quit"]
    mps.stop()  # a second stop does nothing

    monkeypatch.setenv("FAKE_MPS_RC", "1")
    failed = bc.Mps(tmp_path / "w2")
    with pytest.raises(SystemExit, match="exited 1"):
        failed.start()
    failed.stop()  # nothing to quit: no call made
    assert "ask quit" not in (tmp_path / "w2" / "mps_pipe" / "calls").read_text()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # a daemon that did not start is not handed to clients
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match="not on PATH"):
        bc.Mps(work).start()


def test_mps_check_runs_its_client_under_the_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys

    import bench_coserving as bc

    fake_mps(tmp_path, monkeypatch)
    work = tmp_path / "work"
    # the client sees the daemon's pipe directory and its exit code is the check's
    client = [sys.executable, "-c", "import os, sys; sys.exit(7 if os.environ['CUDA_MPS_PIPE_DIRECTORY'] else 1)"]
    assert bc.mps_check(client, work) == 7
    assert (work / "mps_pipe" / "calls").read_text().splitlines() == [
        f"daemon {work / 'mps_log'}", "ask get_server_list", "ask quit"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert bc.mps_check([sys.executable, "-c", "pass"], tmp_path / "w2") == 0
    with pytest.raises(SystemExit, match="did not run to its end"):  # a client that is not there: a clear exit
        bc.mps_check([str(tmp_path / "no_such_client")], tmp_path / "w4")
    assert "ask quit" in (tmp_path / "w4" / "mps_pipe" / "calls").read_text()  # the daemon stopped all the same
    monkeypatch.setenv("FAKE_MPS_RC", "1")
    with pytest.raises(SystemExit, match="exited 1"):  # no daemon: the client is never run
        bc.mps_check([sys.executable, "-c", "raise SystemExit('ran')"], tmp_path / "w3")


def test_report_says_which_policies_ran_under_mps() -> None:
    import bench_coserving as bc

    assert bc._mps_lines({"static": {}, "kvcached": {"mps": False}}) == []
    assert bc._mps_lines({"static": {"mps": True}, "kvcached": {"mps": True}}) == [
        "- CUDA MPS (the engines' kernels side by side): static on, kvcached on"]


def test_report_merges_one_policys_grid_over_two_calls(tmp_path: Path) -> None:
    import bench_coserving as bc

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()

    def write(d: Path, policy: str, runs: list[dict], **extra: object) -> None:
        meta = {**BASE["meta"], "date": d.name, "command": f"run {policy} {d.name}"}
        res = {**BASE, "policy": policy, "runs": runs, "meta": meta, "engine_exit": {"m0": 0}, **extra}
        (d / f"coserving_{policy}.json").write_text(json.dumps(res))

    write(first, "static", [rate_run(1, 0.05), rate_run(2, 0.05)])
    write(first, "kvcached", [rate_run(2, 0.05)])
    write(second, "static", [rate_run(4, 5.0)], not_run=[[1.5, 8, "the time budget (--budget-s 175)"]])
    write(second, "kvcached", [rate_run(4, 0.05)])
    md = tmp_path / "rec.md"
    bc.report([str(first), str(second)], md, "test")
    text = md.read_text()
    # static's 4 req/s (second call) after its 1 and 2 (first): kept up to 2; kvcached's 2 and 4 from two calls
    assert "static 2, kvcached 4 req/s; ratio **2.00**" in text
    assert "- command (static) (a): run static a" in text and "- command (kvcached) (b): run kvcached b" in text
    assert text.count("exit codes {'m0': 0}") == 4
    assert "- not run: static at 8 req/s (skewed trace): the time budget (--budget-s 175)" in text

    # the same rate in both calls: which one counts is not the report's to choose
    write(second, "kvcached", [rate_run(2, 0.05)])
    with pytest.raises(SystemExit, match=r"runs \(skew, rate\) \[\(1.5, 2\)\] again"):
        bc.load_results([str(first), str(second)])
    write(second, "kvcached", [rate_run(4, 0.05)], mps=True)  # another set-up: not one grid
    with pytest.raises(SystemExit, match="differs from the earlier file of that policy in mps"):
        bc.load_results([str(first), str(second)])


def test_the_ratio_says_which_way_the_rates_run_leave_it_open() -> None:
    import bench_coserving as bc

    def grid(static: dict[float, float], kvcached: dict[float, float]) -> dict:
        return {"table": {p: {1.5: {r: {"attainment": {10.0: a}} for r, a in g.items()}}
                          for p, g in (("static", static), ("kvcached", kvcached))}}

    def note(s: dict) -> str:
        best, _ = bc._best(s, 1.5, 10.0, 0.99)
        return bc._grid_note(s, 1.5, best)

    # both grids cover the rates, each policy missed the next one: the ratio stands as run
    assert note(grid({2: 1.0, 3: 0.9, 4.5: 0.8}, {2: 1.0, 3: 1.0, 4.5: 1.0, 6: 0.7})) == ""
    # static not run at 3 (where kvcached was), kvcached kept its highest rate: open both ways
    assert note(grid({2: 1.0}, {3: 1.0, 4.5: 1.0})) == (
        " (the static split not run at 3, 4.5: at most this; kvcached not run above 4.5: at least this)")
    assert note(grid({2: 1.0, 3: 0.97}, {2: 1.0, 3: 1.0, 4.5: 1.0})) == " (kvcached not run above 4.5: at least this)"
    # static missed at 4.5 but was not run at 3, which kvcached kept: static's point may be 3
    assert note(grid({2: 1.0, 4.5: 0.97}, {3: 1.0, 4.5: 1.0, 6: 0.6})) == (
        " (the static split not run at 3: at most this)")
    assert note(grid({2: 0.9}, {2: 1.0})) == ""  # no ratio to qualify
