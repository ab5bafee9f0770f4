"""When greedy speculation parts from the target alone: rounding at a near-tie, or a bug? No mlx.

At temperature 0 speculative decoding reproduces the target alone token for token, as long as a k-token
verification pass computes the same logits as k one-token steps. In float32 it does to within ~1e-5; in
bfloat16, float16 and quantized models the two computations round differently (other matmul shapes, other
kernels), by an amount that depends on the dtype. Where the target's top two choices are closer than that,
either token is the target's own choice, and the two runs may part there: that is not a bug. Where the top
choice clears the runner-up by more than rounding can move it, parting is one.

The evidence is the target's margin at the first differing position — the gap between its top two logits —
in the speculative run's pass and in the plain step (uag.runtime.margins computes both where a run did not keep
them). `classify` takes token ids and per-position margins, so any caller can use it (the app, the CLI's
``--json``, sweeps, the server's stats):

    >>> d = classify([5, 6, 7], [5, 6, 9], dtype="bfloat16", step_margins={2: 0.004}, pass_margins={2: 0.003})
    >>> d.kind, d.position
    ('diverged_near_tie', 2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from uag.models.dtypes import precision

IDENTICAL, NEAR_TIE, DIVERGED = "identical", "diverged_near_tie", "diverged"
KINDS = (IDENTICAL, NEAR_TIE, DIVERGED)

# The largest gap between the target's top two logits that a k-token pass and a one-token step can turn
# around, per dtype: twice the largest change of that gap measured between the two computations
# (benchmarks/dtypes.py, demo target, k = 8; docs/results.md#the-dtypes-users-run-benchmarksdtypespy, on a GPU,
# where it moves most). float16 is not measured: 8 units in the last place of a float16 logit of 16-32
# (0.0156 each). float32 is set by a server's batched passes on a GPU (benchmarks/batch_passes.py --margins;
# docs/results.md, "Many requests at once", rows be and bg): rows of other lengths and widths beside a request's
# move its gap from one-token steps further there than a k-token pass alone does, so that two requests batched
# differently may part where the gap is under twice that; on a CPU the same drift is a thousandth of the bound.
NEAR_TIE_MARGIN = {"float32": 0.08, "bfloat16": 0.75, "float16": 0.125, "q8": 0.625, "q4": 1.25}
UNKNOWN_DTYPE_MARGIN = 1.25  # a dtype not measured (q3, q6, mixed…): as coarse as the coarsest measured

Margins = Mapping[int, float] | Sequence[float | None] | None


def near_tie_margin(dtype: str) -> float:
    """The margin below which rounding in `dtype` (a uag.models.dtypes name or a `LoadedModel.dtype`) can flip
    the target's greedy choice between a k-token pass and a one-token step.

    Example: near_tie_margin("float32") -> 0.08;  near_tie_margin("4-bit (bfloat16)") -> 1.25
    """
    return NEAR_TIE_MARGIN.get(precision(dtype), UNKNOWN_DTYPE_MARGIN)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ; the shorter one's length where one is a prefix of
    the other; None where they are equal.

    Example: [5, 6, 7] vs [5, 6, 9] -> 2;  [5, 6] vs [5, 6, 1] -> 2;  [5, 6] vs [5, 6] -> None
    """
    a, b = list(a), list(b)
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _at(margins: Margins, position: int) -> float | None:
    if margins is None:
        return None
    if isinstance(margins, Mapping):
        value = margins.get(position)
    else:
        value = margins[position] if 0 <= position < len(margins) else None
    return None if value is None else float(value)


@dataclass(frozen=True)
class Divergence:
    """How a speculative run's greedy output compares with the target alone's (see the module doc).

    `position` is 0-based in the generated tokens; the margins are the target's top-two logit gaps there in
    the plain step (`step_margin`) and in the speculative run's pass (`pass_margin`), None when not known.
    """

    kind: str
    dtype: str
    threshold: float
    position: int | None = None
    baseline_token: int | None = None
    speculative_token: int | None = None
    step_margin: float | None = None
    pass_margin: float | None = None

    @property
    def margin(self) -> float | None:
        """The larger known margin: a near-tie needs every computation of the target to call it close."""
        known = [m for m in (self.step_margin, self.pass_margin) if m is not None]
        return max(known) if known else None

    @property
    def is_bug(self) -> bool:
        return self.kind == DIVERGED

    def to_dict(self) -> dict:
        """JSON-ready, with the message (what `--json`, sweeps and the /compare API report)."""
        return {**asdict(self), "margin": self.margin, "message": self.message()}

    def message(self, baseline_piece: str | None = None, speculative_piece: str | None = None) -> str:
        """What to tell the user, in plain words ('' when identical); the pieces are the two tokens' text.

        Example (near-tie): "token 26: the target's top two choices were 0.004 apart; a k-token pass in bfloat16
        rounds differently from a one-token step, as a batched pass does from a request's own, so either is the
        target's own choice — not a bug."
        """
        if self.kind == IDENTICAL:
            return ""
        n = self.position + 1
        what = ""
        if baseline_piece is not None or speculative_piece is not None:
            alone = _piece(baseline_piece, self.baseline_token)
            what = f" ({alone} alone, {_piece(speculative_piece, self.speculative_token)} speculating)"
        if self.kind == NEAR_TIE:
            return (
                f"Outputs part at token {n}{what}: the target's top two choices there were {_num(self.margin)} apart; "
                f"a k-token pass in {precision(self.dtype)} rounds differently from a one-token step, as a batched "
                f"pass does from a request's own (ties closer than {_num(self.threshold)} can turn), so either is the "
                "target's own choice — not a bug."
            )
        if self.baseline_token is None or self.speculative_token is None:
            why = "one run stopped where the other went on, with no token to tell them apart"
        elif self.margin is None:
            why = "the target's margin there is not known, so rounding cannot explain it"
        else:
            why = (
                f"the target's top choice there led by {_num(self.margin)}, more than rounding in "
                f"{precision(self.dtype)} can move ({_num(self.threshold)})"
            )
        return (
            f"Outputs differ at token {n}{what} and this is a bug: at temperature 0 speculative decoding must "
            f"reproduce the target alone, and {why}. Please report it with the prompt, the models, their dtypes "
            "and these settings."
        )


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def _piece(text: str | None, token: int | None) -> str:
    if token is None:
        return "the end"
    return f"{text!r} (id {token})" if text is not None else f"id {token}"


def classify(
    baseline: Sequence[int],
    speculative: Sequence[int],
    *,
    dtype: str,
    step_margins: Margins = None,
    pass_margins: Margins = None,
) -> Divergence:
    """Compare two greedy outputs (target token ids) of one prompt: identical, parted at a near-tie, or a bug.

    `dtype` is the target's (a uag.models.dtypes name or `LoadedModel.dtype`). `step_margins` / `pass_margins`
    give the target's top-two logit gap per generated position (a list, or {position: gap} for the positions
    known) in the plain step and in the speculative pass; only the first differing position is read. A near-tie
    needs a known margin at or below `near_tie_margin(dtype)` in every computation known; a difference with no
    known margin, or where one run simply stopped earlier, is counted as a bug.

    Example: ([5, 6, 7], [5, 6, 9], dtype="float32", step_margins={2: 4.1}) -> kind "diverged", position 2
    """
    threshold = near_tie_margin(dtype)
    position = first_difference(baseline, speculative)
    if position is None:
        return Divergence(IDENTICAL, dtype, threshold)
    token = lambda ids: ids[position] if position < len(ids) else None  # noqa: E731
    found = Divergence(
        DIVERGED,
        dtype,
        threshold,
        position,
        token(baseline),
        token(speculative),
        _at(step_margins, position),
        _at(pass_margins, position),
    )
    tied = found.margin is not None and found.margin <= threshold
    if tied and found.baseline_token is not None and found.speculative_token is not None:
        return Divergence(NEAR_TIE, **{k: v for k, v in asdict(found).items() if k != "kind"})
    return found
