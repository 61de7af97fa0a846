"""The co-serving benchmark's trace, SLO arithmetic and summary: pure Python, no GPU, no vLLM.

Trace: the first 1500 requests of Microsoft's Azure LLM inference trace 2023
(conversation; ``traces/azure_conv_2023_first1500.csv``, see ``traces/README.md``):
arrival times and each request's prompt and output length. A run at rate ``r`` for
``duration`` seconds replays the first ``r * duration`` requests with their
arrival times scaled so that their mean rate is ``r`` (the trace's bursts are
kept, only compressed or stretched). Each request goes to one of the models by a
Zipf popularity (weight of the k-th most popular model ``1 / k**skew``) whose
ranking rotates through the models in equal thirds of the requests, so each model
is the hot one for a third of the run (Prism's traces show models switching between
hot and cold); ``skew=0`` is the uniform trace.

SLO: a request meets it when its time to first token is within ``k`` times the idle
engine's (fitted per model as ``a + b * prompt_len`` from requests sent one at a time
to an idle engine) and its time per output token within ``k`` times the idle one.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

TRACE = Path(__file__).resolve().parent / "traces" / "azure_conv_2023_first1500.csv"


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Request:
    index: int
    at_s: float  # send time from the start of the run
    model: str
    prompt_len: int
    output_len: int


def load_trace(path: Path = TRACE) -> list[TraceRow]:
    with open(path, newline="") as f:
        return [TraceRow(float(r["arrival_s"]), int(r["context_tokens"]), int(r["generated_tokens"]))
                for r in csv.DictReader(f)]


def zipf_weights(n: int, skew: float) -> list[float]:
    """Normalized popularity of the 1st..n-th model; skew 0 is uniform."""
    if n < 1:
        raise ValueError(f"zipf_weights: need at least one model, got {n}.")
    if skew < 0 or not math.isfinite(skew):
        raise ValueError(f"zipf_weights: skew must be a finite number >= 0, got {skew}.")
    w = [1.0 / (k ** skew) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def build_trace(models: Sequence[str], rate: float, duration_s: float, skew: float, *, seed: int = 0,
                rows: Sequence[TraceRow] | None = None, max_prompt: int | None = None) -> list[Request]:
    """The requests of one run (see the module docstring); deterministic for a seed."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"build_trace: rate and duration must be > 0, got {rate} and {duration_s}.")
    rows = load_trace() if rows is None else rows
    n = max(1, round(rate * duration_s))
    if n > len(rows):
        raise ValueError(f"build_trace: {n} requests asked for, the trace has {len(rows)}; lower rate x duration.")
    window = rows[:n]
    t0 = window[0].arrival_s
    span = window[-1].arrival_s - t0
    scale = (n / rate) / span if span > 0 else 0.0
    weights = zipf_weights(len(models), skew)
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(window):
        phase = i * 3 // n  # thirds of the run; the ranking rotates once per third
        ranked = [models[(j + phase) % len(models)] for j in range(len(models))]
        model = rng.choices(ranked, weights)[0]
        plen = row.prompt_len if max_prompt is None else min(row.prompt_len, max_prompt)
        out.append(Request(i, (row.arrival_s - t0) * scale, model, max(1, plen), max(1, row.output_len)))
    return out


def prompt_ids(request: Request, seed: int = 0, low: int = 1000, high: int = 30000) -> list[int]:
    """The request's prompt as token ids (random, fixed by seed and index: no prefix-cache hits)."""
    rng = random.Random(seed * 1_000_003 + request.index)
    return [rng.randrange(low, high) for _ in range(request.prompt_len)]


@dataclass
class Outcome:
    """One request as the client saw it (seconds)."""

    index: int
    model: str
    prompt_len: int
    output_len: int
    sent_s: float  # from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    chunks: int = 0  # stream events that carried tokens: fewer than the tokens means a coalesced stream
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass(frozen=True)
class IdleModel:
    """An idle engine's latency: TTFT = a + b * prompt_len, and its TPOT."""

    ttft_a: float
    ttft_b: float
    tpot: float

    def ttft(self, prompt_len: int) -> float:
        return self.ttft_a + self.ttft_b * prompt_len


def fit_idle(samples: Iterable[tuple[int, float, float]]) -> IdleModel:
    """Least-squares TTFT line and median TPOT from (prompt_len, ttft, tpot) of idle requests."""
    pts = list(samples)
    if len(pts) < 2:
        raise ValueError(f"fit_idle: need at least two idle samples, got {len(pts)}.")
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    b = max(b, 0.0)
    a = my - b * mx
    a = max(a, min(ys) / 2)  # a noisy fit must not make a short prompt's SLO tiny
    tpots = sorted(p[2] for p in pts)
    return IdleModel(a, b, tpots[len(tpots) // 2])


def slo_miss(o: Outcome, idle: IdleModel, k: float) -> str | None:
    """What a request missed of its SLO at ``k`` ("error", "ttft", "tpot", "both"), or None where it met it."""
    if o.error is not None or o.ttft_s is None:
        return "error"
    late = o.ttft_s > k * idle.ttft(o.prompt_len)
    slow = o.tpot_s is not None and o.tpot_s > k * idle.tpot
    return ("both" if slow else "ttft") if late else "tpot" if slow else None


def meets_slo(o: Outcome, idle: IdleModel, k: float) -> bool:
    return slo_miss(o, idle, k) is None


def attainment(outcomes: Sequence[Outcome], idle: dict[str, IdleModel], k: float) -> float:
    if not outcomes:
        return float("nan")
    return sum(meets_slo(o, idle[o.model], k) for o in outcomes) / len(outcomes)


def misses(outcomes: Sequence[Outcome], idle: dict[str, IdleModel], k: float) -> dict[int, str]:
    """Each request that missed its SLO at ``k``, by trace index: what it missed (:func:`slo_miss`)."""
    return {o.index: m for o in outcomes if (m := slo_miss(o, idle[o.model], k)) is not None}


def shared_misses(elastic: dict[int, str], static: dict[int, str]) -> tuple[int, int]:
    """Of the elastic policy's misses (from :func:`misses`, same trace and rate), how many the static split missed
    too, and how many it met: the misses both have come from the trace on a shared GPU, not from either cache."""
    both = sum(1 for i in elastic if i in static)
    return both, len(elastic) - both


def max_rate(points: dict[float, float], target: float = 0.99) -> float | None:
    """Highest rate whose attainment, and every lower rate's, is >= target; None if the lowest misses."""
    best = None
    for rate in sorted(points):
        if not points[rate] >= target:
            break
        best = rate
    return best


def percentile(values: Sequence[float], q: float) -> float:
    vals = sorted(values)
    if not vals:
        return float("nan")
    pos = (len(vals) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def kv_bytes_per_token(config: dict) -> int:
    """K and V bytes one token takes in every layer of a model (bf16), from its HF config."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 2


def kv_demand(outcomes: Sequence[Outcome], per_token: dict[str, int], step: float = 0.1) -> list[tuple[float, dict]]:
    """KV bytes the requests in flight need, per model, every ``step`` seconds: a request from its sending (waiting
    included) to its end, its prompt and the output tokens it has so far (spread evenly between the first token and
    the last). Models without a ``per_token`` figure and failed requests are left out."""
    done = [o for o in outcomes if o.model in per_token and o.error is None and o.e2e_s is not None]
    if not done:
        return []
    end = max(o.sent_s + o.e2e_s for o in done)
    out = []
    for i in range(int(end / step) + 1):
        t = i * step
        need = {m: 0 for m in per_token}
        for o in done:
            if not o.sent_s <= t <= o.sent_s + o.e2e_s:
                continue
            first = o.sent_s + (o.ttft_s if o.ttft_s is not None else o.e2e_s)
            last = o.sent_s + o.e2e_s
            if t < first:
                tokens = 0.0
            elif last <= first:
                tokens = float(o.tokens)
            else:
                tokens = 1 + (o.tokens - 1) * (t - first) / (last - first)
            need[o.model] += int((o.prompt_len + tokens) * per_token[o.model])
        out.append((round(t, 6), need))
    return out


def demand_peak(curve: list[tuple[float, dict]]) -> tuple[float, dict] | None:
    """The sample of ``kv_demand`` where all models together needed the most: (time, bytes per model)."""
    return max(curve, key=lambda tm: sum(tm[1].values())) if curve else None


def rate_grid(low: float, high: float, factor: float) -> list[float]:
    """Geometric grid low, low*factor, ... up to high (rounded to 0.01)."""
    if not (0 < low <= high) or factor <= 1:
        raise ValueError(f"rate_grid: need 0 < low <= high and factor > 1, got {low}, {high}, {factor}.")
    out, r = [], low
    while r <= high * (1 + 1e-9):
        out.append(round(r, 2))
        r *= factor
    return out


def memory_bound_rates(models: Sequence[str], per_token: dict[str, int], slice_bytes: int, rates: Sequence[float],
                       duration_s: float, skew: float, *, ttft_s: float, tpot_s: float, seed: int = 0,
                       rows: Sequence[TraceRow] | None = None) -> tuple[float | None, float | None]:
    """What the trace alone allows, before a run: the highest of ``rates`` (each lower one too) at which the static
    split's hottest engine needs no more than its slice, and at which all engines together need no more than the
    whole budget (``len(models)`` slices), every request held from its arrival for ``ttft_s + tpot_s x output``
    (a fixed latency: no queueing, no preemption). The ratio of the two is the most an elastic cache can gain on
    this trace at that latency; it is an estimate, not a measurement."""
    missing = [m for m in models if m not in per_token]
    if missing or slice_bytes <= 0 or ttft_s < 0 or tpot_s < 0:
        raise ValueError(f"memory_bound_rates: every model needs its KV bytes per token (missing {missing}), the "
                         f"slice must be > 0 bytes and the latencies >= 0 (got {slice_bytes}, {ttft_s}, {tpot_s}).")
    static = elastic = None
    static_ok = elastic_ok = True
    for rate in sorted(rates):
        reqs = build_trace(models, rate, duration_s, skew, seed=seed, rows=rows)
        outs = [Outcome(r.index, r.model, r.prompt_len, r.output_len, r.at_s, ttft_s, ttft_s + tpot_s * r.output_len,
                        r.output_len) for r in reqs]
        curve = kv_demand(outs, per_token)
        static_ok = static_ok and max(max(need.values()) for _, need in curve) <= slice_bytes
        elastic_ok = elastic_ok and sum(demand_peak(curve)[1].values()) <= len(models) * slice_bytes
        static = rate if static_ok else static
        elastic = rate if elastic_ok else elastic
        if not (static_ok or elastic_ok):  # a higher rate cannot count for either
            break
    return static, elastic
