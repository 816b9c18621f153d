"""The per-step speculation policy: how many drafts per request this step verifies
(``k'`` in ``0..num_speculative_tokens``), chosen to maximise expected emitted tokens per
unit of time.  Torch-free: the scheduler runs it.

```
 expected tokens of a request with m drafts   E(m) = 1 + sum_{i=1..m} a_1 a_2 ... a_i
 (a_i: P(draft i accepted | drafts < i accepted), an EMA of what verification saw)

 gain(k') = [sum_r E(min(m_r, k')) / B]  /  [cost(B + sum_r min(m_r, k')) / cost(B)]
             tokens emitted per request       time of the verify step relative to a
             (B running, m_r drafts each)     plain decode step (the measured curve)

 k' = argmax gain, and 0 unless that gain >= MIN_GAIN (3%)
```

``cost`` is a :class:`StepCostCurve`, measured by the worker at start-up (never
guessed; ``worker/step_cost.py``): on CUDA the replay times the graph capture already
takes of every decode graph (a plain step of B requests replays the decode graph of
size >= B) and every chunk graph (a verify step of T tokens replays the chunk graph of
size >= T); running eagerly (CPU, ``enforce_eager``), forwards of 1, 2, 4, ... tokens
timed once at start-up.  Neither includes the context's attention (captured at context
0-1): real contexts add the same KV reads to both steps, so the measured ratio is an
upper bound -- the policy errs towards not speculating.

The curve covers the forward only; what else a verify step costs (logits of k + 1 rows,
rejection sampling, proposing, and the host's work, which async scheduling hides for
plain steps but not for speculating ones, as they run synchronously) is calibrated
online from each step's wall time (a loop period: ``scheduling._period``): the policy
keeps EMAs of measured / predicted time for plain decode steps and for speculating steps
-- verifying drafts and proposing the next: a draft model's forwards count here
(:meth:`SpecPolicy.observe_time`) -- per batch-size bucket (1, 2-3, 4-7, ...: host costs
grow with the requests, not with the forward's time), and their quotient at the bucket
nearest the step's (each kind from its nearest timed bucket) scales the predicted verify
cost.  Speculation that stays on times no plain step, so every ``PLAIN_PROBE_GAP``
speculating steps (the first after ``FIRST_PLAIN_PROBE``) it proposes nothing for three
steps: the first verifies the last drafts, the second is plain but follows a synchronous
step, the third is a plain step in the loop's steady state, the one timed
(``SpecScheduling.end_step`` times a plain step only after a plain step).

Acceptance starts optimistic (the prior ``PRIOR_ACCEPTANCE`` at position 1, each later
position's prior being the estimate of the one before), so speculation is tried; when
the policy turns drafts off while the uncalibrated curve would allow them at the prior's
acceptance (low acceptance, or a costly calibration), it keeps *probing*: after
``probe_gap`` plain steps drafts are proposed for one step, which verifies them at the
prior's choice of k' and proposes again (so it is timed as a speculating step); the gap
is sized so that probes cost at most ``PROBE_BUDGET`` (1%) of the time (calibrated),
and at least ``MIN_PROBE_GAP`` steps.  The first timed step of each kind is not counted
(first-call costs), and a step counts at most twice the current factor (stalls).  No randomness:
given the same curve and the same step times, the same steps carry drafts.

``disable_by_batch_size`` (vLLM's name) stays a hard cap above this: no drafts while
more requests run.

Whatever it decides, greedy output is unchanged: drafts are verified by the target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_GAIN = 1.03  # speculate only for at least 3% more expected tokens per unit time
PRIOR_ACCEPTANCE = 0.5  # P(draft 1 accepted) before anything was verified
AVAIL_PRIOR_WEIGHT = 4.0  # the draft-availability prior (1.0) counts as 4 requests
PRIOR_WEIGHT = 4.0  # the prior counts as this many verified drafts per position
DECAY = 0.9  # per verify step: the acceptance estimate remembers ~10 steps
TIME_DECAY = 0.9  # per timed step: the time calibration likewise
PROBE_BUDGET = 0.01  # probes take at most ~1% of the time while speculation is off
MIN_PROBE_GAP = 16
MAX_PROBE_GAP = 4096
# While speculating: a plain step is timed after this many speculating steps (the first
# one sooner), so that the calibration compares like with like; two steps without
# proposals each time (~1.5% of the speculation's gain).
PLAIN_PROBE_GAP = 128
FIRST_PLAIN_PROBE = 8


def _bucket(num_reqs: int) -> int:
    """The time calibration's batch-size bucket: 1, 2-3, 4-7, 8-15, ... -> 1, 2, 3, 4, ..."""
    return num_reqs.bit_length()


def _lookup(points: Sequence[tuple[int, float]], x: int, padded: bool) -> float:
    """The curve ``points`` ((size, ms), ascending) at ``x``: the smallest size >= x
    (``padded``: a step pads up to a captured graph) or linear interpolation; below the
    first point its time.  Beyond the last: padded (such a step runs eagerly, unmeasured)
    or from a single point, proportional to the size (compute-bound, the pessimistic
    bound); else the last segment's slope continued."""
    x0, y0 = points[0]
    if x <= x0:
        return y0
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        if x <= xb:
            return yb if padded else ya + (yb - ya) * (x - xa) / (xb - xa)
    xl, yl = points[-1]
    if padded or len(points) == 1:
        return yl * x / xl
    xa, ya = points[-2]
    return yl + max(yl - ya, 0.0) * (x - xl) / (xl - xa)


@dataclass(frozen=True)
class StepCostCurve:
    """Measured forward times in ms.  ``decode``: (requests, ms) of decode-only steps
    (empty: use ``mixed`` at one token per request); ``mixed``: (tokens, ms) of steps
    with several tokens per request (a verify step).  ``padded``: steps pad up to the
    next measured size (CUDA graphs), else interpolate.  ``source``: how it was
    measured, for the start-up log."""

    decode: tuple[tuple[int, float], ...]
    mixed: tuple[tuple[int, float], ...]
    padded: bool
    source: str

    def __post_init__(self) -> None:
        if not self.mixed:
            raise ValueError("StepCostCurve: no mixed-step points")

    def decode_ms(self, num_reqs: int) -> float:
        """A plain step: ``num_reqs`` requests of one token."""
        if self.decode:
            return _lookup(self.decode, num_reqs, self.padded)
        return _lookup(self.mixed, num_reqs, self.padded)

    def mixed_ms(self, num_tokens: int) -> float:
        """A verify step of ``num_tokens`` scheduled tokens."""
        return _lookup(self.mixed, num_tokens, self.padded)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (msgpack across processes)."""
        return {"decode": [list(p) for p in self.decode],
                "mixed": [list(p) for p in self.mixed],
                "padded": self.padded, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepCostCurve:
        return cls(tuple((int(a), float(b)) for a, b in d["decode"]),
                   tuple((int(a), float(b)) for a, b in d["mixed"]),
                   bool(d["padded"]), str(d["source"]))

    def describe(self) -> str:
        def fmt(pts: Sequence[tuple[int, float]]) -> str:
            return " ".join(f"{n}:{ms:.2f}" for n, ms in pts)
        dec = f"decode (requests:ms) {fmt(self.decode)}; " if self.decode else ""
        return f"{self.source}: {dec}verify (tokens:ms) {fmt(self.mixed)}"


class AcceptanceEstimate:
    """Per draft position i, an EMA of P(draft i accepted | drafts < i accepted),
    shrunk towards a prior: position 1's is ``prior``, position i's the estimate of
    position i - 1 (a position never tried looks like the one before it)."""

    def __init__(self, k: int, prior: float = PRIOR_ACCEPTANCE,
                 weight: float = PRIOR_WEIGHT, decay: float = DECAY) -> None:
        self.k, self.prior, self.weight, self.decay = k, prior, weight, decay
        self.hits = [0.0] * k
        self.tries = [0.0] * k

    def update(self, tries: Sequence[int], hits: Sequence[int]) -> None:
        """One verify step's counts: ``tries[i]`` drafts at position i + 1 were checked
        (their predecessors all accepted), ``hits[i]`` of them accepted."""
        d = self.decay
        for i in range(self.k):  # over positions (<= 32), not tokens
            self.tries[i] = d * self.tries[i] + tries[i]
            self.hits[i] = d * self.hits[i] + hits[i]

    def rates(self) -> list[float]:
        out, prev = [], self.prior
        for h, t in zip(self.hits, self.tries):
            prev = (h + self.weight * prev) / (t + self.weight)
            out.append(prev)
        return out


def expected_tokens(rates: Sequence[float]) -> list[float]:
    """E(m) for m = 0..len(rates): tokens a request with m drafts emits on average."""
    out, p = [1.0], 1.0
    for a in rates:
        p *= a
        out.append(out[-1] + p)
    return out


class SpecPolicy:
    """See the module doc.  Per step the scheduler calls :meth:`plan` (this step's k'
    given the running requests' draft counts, and how many drafts the runner should
    propose for the next step), then after the step :meth:`observe` (acceptance) and
    :meth:`observe_time` (wall time)."""

    def __init__(self, k: int, curve: StepCostCurve | None,
                 max_batch: int | None = None, min_gain: float = MIN_GAIN) -> None:
        """``curve`` None (no measurement, e.g. a scheduler without a runner): cost is
        taken as flat, so only acceptance decides."""
        self.k = k
        self.curve = curve
        self.max_batch = max_batch
        self.min_gain = min_gain
        self.acceptance = AcceptanceEstimate(k)
        self._avail = [0.0, 0.0]  # EMAs of requests given drafts, of requests asked
        self._prior_rates = AcceptanceEstimate(k).rates()
        # EMAs of measured and of predicted step time, [plain, verify] steps: over all
        # steps, and per batch-size bucket (``_bucket``)
        self._time = [[0.0, 0.0], [0.0, 0.0]]
        self._btime: dict[int, list[list[float]]] = {}
        self._seen = [False, False]  # a step of the kind was timed (and not counted)
        self._idle = 0  # plain steps since speculation was last tried
        self._probe_next = False
        self.num_probes = 0
        # Speculating steps since a plain step was last timed, and the plain steps left
        # of a plain probe (below).
        self._spec_run = 0
        self._plain_left = 0
        self.num_plain_probes = 0

    # -- the decision --------------------------------------------------------------------
    def _cost_ratio(self, num_reqs: int, num_tokens: int, calibrated: bool = True,
                    ) -> float:
        """Predicted time of a verify step of ``num_tokens`` tokens over that of a plain
        step of ``num_reqs``, calibrated by the measured step times (or not)."""
        if self.curve is None:
            return 1.0
        raw = self.curve.mixed_ms(num_tokens) / self.curve.decode_ms(num_reqs)
        if not calibrated or self._time[True][1] <= 0 or self._time[False][1] <= 0:
            return raw  # (until both kinds were timed there is nothing to compare)
        return raw * self.time_factor(True, num_reqs) / self.time_factor(False, num_reqs)

    def time_factor(self, verify: bool, num_reqs: int | None = None) -> float:
        """Measured over predicted time of plain (or speculating) steps so far: at the
        timed bucket nearest ``num_reqs``'s (the smaller on a tie), or over all steps
        (``num_reqs`` None, or no step of the kind timed in any bucket); until one of a
        kind was timed, the other kind's (same overheads), or 1."""
        if num_reqs is not None:
            b = _bucket(num_reqs)
            timed = [key for key, t in self._btime.items() if t[verify][1] > 0]
            if timed:  # over buckets (<= 64), not requests
                measured, predicted = self._btime[min(timed, key=lambda key: (
                    abs(key - b), key))][verify]
                return measured / predicted
        for measured, predicted in (self._time[verify], self._time[not verify]):
            if predicted > 0:
                return measured / predicted
        return 1.0

    def best(self, num_reqs: int, hist: Sequence[int], rates: Sequence[float],
             calibrated: bool = True) -> tuple[int, float]:
        """(k', gain) maximising gain for ``num_reqs`` requests of which ``hist[m]``
        have m drafts ready (m = 0..k), under acceptance ``rates``; k' = 0 (gain 1.0)
        when no k' reaches ``min_gain``."""
        if num_reqs <= 0 or (self.max_batch is not None and num_reqs > self.max_batch):
            return 0, 1.0
        e = expected_tokens(rates)
        best_k, best_gain = 0, 1.0
        for kp in range(1, self.k + 1):  # over k' (<= 32) x draft counts (<= 33)
            extra = emitted = 0.0
            for m, n in enumerate(hist):
                if n:
                    c = min(m, kp)
                    extra += n * c
                    emitted += n * (e[c] - 1.0)
            if not extra:
                break  # no request has drafts
            gain = (1.0 + emitted / num_reqs) / self._cost_ratio(
                num_reqs, num_reqs + int(extra), calibrated)
            if gain > best_gain:
                best_k, best_gain = kp, gain
        return (best_k, best_gain) if best_gain >= self.min_gain else (0, 1.0)

    def plan(self, num_reqs: int, hist: Sequence[int]) -> tuple[int, int]:
        """(k' for this step, drafts per request to propose for the next step).

        ``hist[m]``: how many of the ``num_reqs`` running requests hold m drafts.  The
        proposal count assumes the next step looks like this one with full drafts."""
        rates = self.acceptance.rates()
        full = [0] * self.k + [num_reqs]
        # What the next step can expect: only the share of requests whose proposer has
        # been finding drafts (n-gram finds none in text that never repeats) brings any.
        m = round(num_reqs * self.availability())
        expected = [num_reqs - m] + [0] * (self.k - 1) + [m]
        if self._probe_next:  # drafts were proposed for a probe: verify at the prior,
            # and propose again, so that the probe is timed as a speculating step
            self._probe_next = False
            self.num_probes += 1
            k_now = self.best(num_reqs, hist, self._prior_rates, calibrated=False)[0]
            return k_now, k_now
        k_now = self.best(num_reqs, hist, rates)[0]
        k_next = self.best(num_reqs, expected, rates)[0]
        if self._plain_left:  # a plain probe: propose nothing for three steps
            self._plain_left -= 1
            return k_now, 0
        if k_next:
            self._idle = 0
            self._spec_run += 1
            if self._spec_run >= (PLAIN_PROBE_GAP if self._time[False][1] else
                                  FIRST_PLAIN_PROBE):
                # While speculation stays on no plain step is timed, so the calibration
                # would compare speculating steps with stale (or no) plain ones: three
                # steps without proposals give one steady plain step to time.
                self._spec_run = 0
                self._plain_left = 2
                self.num_plain_probes += 1
                return k_now, 0
            return k_now, k_next
        # Probe while the measured curve alone (not its calibration, which may be stale)
        # allows speculation at the prior's acceptance.
        k_prior = self.best(num_reqs, full, self._prior_rates, calibrated=False)[0]
        if not k_prior:
            return k_now, 0  # the curve says no whatever acceptance: nothing to probe
        self._idle += 1
        if self._idle >= self.probe_gap(num_reqs, k_prior):
            self._idle = 0
            self._probe_next = True
            return k_now, k_prior
        return k_now, 0

    def probe_gap(self, num_reqs: int, k: int) -> int:
        """Plain steps between probes: a probe at k' drafts per request costs about
        cost_ratio - 1 plain steps more than a plain step, held to ``PROBE_BUDGET``."""
        extra = self._cost_ratio(num_reqs, num_reqs * (k + 1)) - 1.0
        gap = math.ceil(max(extra, 0.0) / PROBE_BUDGET)
        # While proposals find nothing the probe is for that, and it costs more than its
        # verify step: a synchronous step (n-gram pauses async scheduling for it).
        # Probe less often as the share of requests given drafts falls (up to 8x).
        gap = math.ceil(max(gap, MIN_PROBE_GAP) / max(self.availability(), 0.125))
        return min(gap, MAX_PROBE_GAP)

    # -- what the step showed ----------------------------------------------------------------
    def observe(self, tries: Sequence[int], hits: Sequence[int]) -> None:
        """Per-position counts of one verify step (``AcceptanceEstimate.update``)."""
        self.acceptance.update(tries, hits)

    def observe_proposals(self, asked: int, got: int) -> None:
        """After a step that proposed: ``got`` of the ``asked`` requests received drafts."""
        d = DECAY
        self._avail[0] = d * self._avail[0] + got
        self._avail[1] = d * self._avail[1] + asked

    def availability(self) -> float:
        """The share of requests a proposal round gives drafts to (an EMA over proposing
        steps, shrunk towards 1: before anything was proposed, everyone is expected to
        get drafts)."""
        got, asked = self._avail
        return (got + AVAIL_PRIOR_WEIGHT) / (asked + AVAIL_PRIOR_WEIGHT)

    def observe_time(self, ms: float, num_reqs: int, num_tokens: int, verify: bool) -> None:
        """A decode-only step (every request one token, plus drafts when ``verify``)
        took ``ms`` of wall time: calibrate the curve's prediction for its kind."""
        if self.curve is None or num_reqs <= 0:
            return
        if not verify:
            self._spec_run = 0
        if not self._seen[verify]:  # its first-call costs (allocations, kernel loads)
            self._seen[verify] = True
            return
        pred = self.curve.mixed_ms(num_tokens) if verify else self.curve.decode_ms(num_reqs)
        bucket = self._btime.setdefault(_bucket(num_reqs), [[0.0, 0.0], [0.0, 0.0]])
        for t in (self._time[verify], bucket[verify]):
            # An outlier (a stall) counts at most twice the current factor.
            m = min(ms, 2.0 * pred * t[0] / t[1]) if t[1] > 0 else ms
            t[0] = TIME_DECAY * t[0] + m
            t[1] = TIME_DECAY * t[1] + pred

    def describe(self) -> str:
        cap = "none" if self.max_batch is None else str(self.max_batch)
        curve = self.curve.describe() if self.curve is not None else "none (flat cost)"
        return (f"per-step k' in 0..{self.k} maximising expected tokens per unit time "
                f"(min gain {self.min_gain:.2f}, prior acceptance {PRIOR_ACCEPTANCE}, "
                f"disable_by_batch_size {cap}); step cost {curve}")
