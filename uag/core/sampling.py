"""How the target picks its token: mlx-lm's logits processors (repetition, presence and frequency penalties,
which read the tokens before the position), then mlx-lm's sampler (the temperature after top_p, min_p, top_k).

Speculation stays lossless only if every position the target verifies is picked exactly as the target alone
would pick it there: `TargetSampling.rows` gives each row of a verify pass its own token history (the committed
tokens and the proposal before it) and its own grammar mask (a `constraint`: uag.core.grammar), and
`distribution` is what the sampler draws from, for rejection sampling. The history is always the whole committed
sequence, prompt included, whatever a conversation's cache held.

Example: TargetSampling.of(GenerationConfig(repetition_penalty=1.3)).choose(logits) -> the penalized argmax
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    categorical_sampling,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

from uag.core.config import GenerationConfig
from uag.core.passes import logprobs

if TYPE_CHECKING:
    from uag.core.grammar import Matcher

PENALTY_CONTEXT = 20  # tokens the penalties look back over: mlx-lm's default (make_logits_processors)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def truncation(config: GenerationConfig) -> Callable[[mx.array], mx.array] | None:
    """top_p, min_p and top_k as mlx-lm's `make_sampler` chains them (same functions, same order), on
    log-probabilities of shape (..., V); None where none cuts anything. A top_k at or above V keeps every token
    (mlx-lm's apply_top_k refuses it)."""
    if not config.truncated:
        return None
    top_p, min_p, top_k = config.top_p, config.min_p, config.top_k

    def cut(x: mx.array) -> mx.array:
        if 0 < top_p < 1:
            x = apply_top_p(x, top_p)
        if min_p:
            x = apply_min_p(x, min_p)
        if 0 < top_k < x.shape[-1]:
            x = apply_top_k(x, top_k)
        return x

    return cut


def penalties(config: GenerationConfig) -> list[LogitsProcessor]:
    """mlx-lm's logits processors for the config's penalties ([] where none is set)."""
    if not config.penalized:
        return []
    return make_logits_processors(
        repetition_penalty=config.repetition_penalty if config.repetition_penalty != 1 else None,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=config.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=config.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT,
    )


@mx.compile
def _masked(logits: mx.array, words: mx.array) -> mx.array:
    """logits (n, V) with every token whose bit is clear in `words` (n, ⌈V/32⌉ uint32) set to -inf: plain mx ops,
    so it runs on every backend (llguidance's own MLX helper is a Metal kernel). No module-level array: MLX arrays
    belong to the thread that made them, and a server runs the engine on its worker thread."""
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = ((words[..., None] >> shifts) & 1).reshape(words.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(bits.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))


def masked(logits: mx.array, rows) -> mx.array:
    """`logits` (n, V) under grammar mask `rows` (n, words) int32 from uag.core.grammar.Matcher.masks."""
    return _masked(logits, mx.array(rows.view("uint32")))


def greedy_ids(logits: mx.array) -> list[int] | None:
    """Each row's argmax of its log-probabilities (logits - logsumexp, what mlx-lm's greedy sampler reads), found
    without the log-sum-exp: None where that could differ from the logits' own argmax, for the caller to take the
    whole path. On a CPU the exponentials over a large vocabulary cost 10x the argmax (262,144 ids, 9 rows: the
    whole path 37 ms, this one 6.7; docs/results.md, dc); on a GPU either is a few launches of microseconds.

    The subtraction keeps the order of the logits but rounds: two logits closer than the spacing of the dtype's
    numbers near log V (where every log-probability near the top lies) can become equal, and argmax then takes the
    first of them (bfloat16: 0.01 above zeros is a tie at -log V). So the logits' argmax is the answer only where
    nothing but the top value itself lies within twice that spacing of it; a top value that is not finite also
    takes the whole path.

    Example: [[0.1, 3.0, 2.0]] -> [1];  bfloat16 [[0, …, 0.01, …]] over 262,144 ids -> None (it is 0 there)
    """
    ids, sure = _argmax_if_sure(logits)
    mx.eval(ids, sure)
    return ids.tolist() if sure.item() else None


def _argmax_if_sure(logits: mx.array) -> tuple[mx.array, mx.array]:
    """`greedy_ids`' graph, not evaluated: the logits' argmax per row, and whether it is sure to be the answer."""
    top = mx.max(logits, axis=-1, keepdims=True)
    reach = math.log(logits.shape[-1]) + 1  # |log p| of every value near the top, with room for rounding
    slack = 2 * mx.finfo(logits.dtype).eps * 2 ** math.ceil(math.log2(reach))
    near = mx.sum(logits >= top - slack, axis=-1) - mx.sum(logits == top, axis=-1)
    return mx.argmax(logits, axis=-1), (mx.max(near) == 0) & mx.all(mx.isfinite(top))


@dataclass(frozen=True)
class Picks:
    """The target's greedy choice at each row of a pass's logits, built but not yet read (`greedy_picks`). Built
    beside a pass and evaluated with it (`arrays`), several requests' picks cost the batch's pass no read-back of
    their own (uag.runtime.batching); `read()` copies them out (evaluating them first where nobody has)."""

    ids: mx.array
    sure: mx.array | None = None  # on a CPU: whether `ids`, the logits' own argmax, is the answer (`greedy_ids`)
    logits: mx.array | None = None  # where it may not be, the whole path is taken on these

    @property
    def arrays(self) -> list[mx.array]:
        return [self.ids] if self.sure is None else [self.ids, self.sure]

    def read(self) -> list[int]:
        mx.eval(self.arrays)
        if self.sure is None or self.sure.item():
            return self.ids.tolist()
        return greedy_sampler(logprobs(self.logits)).tolist()


def greedy_picks(logits: mx.array) -> Picks:
    """mlx-lm's greedy choice at each row of `logits` (n, V), not yet read: on a CPU the logits' own argmax where
    rounding cannot matter (`greedy_ids`: the exponentials cost 10x the argmax there), else the sampler's own path
    (on a GPU the log-sum-exp costs what the shortcut's own few kernels would)."""
    if mx.default_device().type != mx.cpu:
        return Picks(greedy_sampler(logprobs(logits)))
    ids, sure = _argmax_if_sure(logits)
    return Picks(ids, sure, logits)


@dataclass(frozen=True)
class TargetSampling:
    """The target's choice of token in one run: `processors` (penalties; [] when none), then `sampler` (on
    log-probabilities), whose draw at temperature > 0 follows `distribution`."""

    temperature: float
    processors: list[LogitsProcessor]
    sampler: Sampler
    cut: Callable[[mx.array], mx.array] | None = None  # top_p / min_p / top_k, as the sampler applies them
    grammar: Matcher | None = None  # the run's constraint, following the committed tokens (None: no constraint)

    @classmethod
    def of(
        cls, config: GenerationConfig, sampler: Sampler | None = None, grammar: Matcher | None = None
    ) -> TargetSampling:
        """The config's sampling; `sampler` replaces the sampler (tests), the penalties still apply; `grammar`: the
        run's matcher for the config's constraint."""
        cut = truncation(config)
        if sampler is None:
            if cut is None:
                sampler = make_sampler(config.temperature)  # exactly mlx-lm's, as the target alone uses
            else:
                temperature = config.temperature
                sampler = lambda x: categorical_sampling(cut(x), temperature)  # noqa: E731  make_sampler's last step
        return cls(config.temperature, penalties(config), sampler, cut, grammar)

    def process(self, history: mx.array, logits: mx.array) -> mx.array:
        """One position's logits (1, V) after the penalties, given the tokens up to and including its input."""
        for processor in self.processors:
            logits = processor(history, logits)
        return logits

    def rows(self, committed: Sequence[int], proposed: Sequence[int], logits: mx.array) -> mx.array:
        """A verify pass's logits (n + 1, V) for its inputs [committed[-1], *proposed], each row penalized as
        the target alone would at that position: with history committed + proposed[:i] (generate_step's).

        Example: committed [.., 7], proposed [5, 6] -> rows after [.., 7], [.., 7, 5], [.., 7, 5, 6]
        """
        if self.processors:
            tail = list(committed[-PENALTY_CONTEXT:])
            window = mx.array([*tail, *proposed])
            rows = [self.process(window[: len(tail) + i], logits[i : i + 1]) for i in range(logits.shape[0])]
            logits = mx.concatenate(rows)
        if self.grammar is not None:  # row i: what the grammar allows after proposed[:i]
            logits = masked(logits, self.grammar.masks(proposed))
        return logits

    def step(self, history: mx.array | None, logits: mx.array) -> mx.array:
        """One plain step's logits (1, V): the penalties over `history`, then the grammar's mask where it stands."""
        if self.processors:
            logits = self.process(history, logits)
        if self.grammar is not None:
            logits = masked(logits, self.grammar.masks(()))
        return logits

    def choose(self, logits: mx.array) -> mx.array:
        """The target's token for each row of (already penalized) logits: argmax, or a draw."""
        return self.sampler(logprobs(logits))

    def ids(self, logits: mx.array) -> list[int]:
        """`choose(logits)` read back; greedy, as `greedy_picks` reads it (on a CPU without the log-sum-exp where
        rounding cannot matter)."""
        if self.greedy:
            return greedy_picks(logits).read()
        return self.choose(logits).tolist()

    @property
    def greedy(self) -> bool:
        """Whether the sampler is mlx-lm's greedy one (temperature 0, no cut): argmax of the log-probabilities."""
        return self.sampler is greedy_sampler

    @property
    def by_argmax(self) -> bool:
        """Whether each row of a pass is picked from its own logits alone, greedily (no penalties, which read the
        tokens before it, no grammar, which follows one proposal): what a batch can pick for its members with the
        pass itself (`greedy_picks`; uag.core.passes.verify_pass)."""
        return self.greedy and not self.processors and self.grammar is None

    def distribution(self, logits: mx.array) -> mx.array:
        """What the sampler draws from, per row of (already penalized) logits, at temperature > 0: the
        softmax at the temperature after top_p, min_p and top_k (for rejection sampling)."""
        x = logits if self.cut is None else self.cut(logprobs(logits))
        return mx.softmax(x.astype(mx.float32) / self.temperature, axis=-1)

    def with_prefix(self, prefix: Sequence[int], prompt: int) -> list[LogitsProcessor]:
        """The processors for mlx-lm's generate_step reading a prompt after a cache already held `prefix`:
        generate_step shows them only what it read itself (`prompt` tokens, then each token it generated), so the
        prefix's tail is put back in front; the grammar, last, follows the generated tokens."""
        processors = self.processors
        if prefix and processors:
            head = mx.array(list(prefix[-PENALTY_CONTEXT:]))
            processors = [lambda tokens, logits, p=p: p(mx.concatenate([head, tokens]), logits) for p in processors]
        if self.grammar is not None:
            processors = [*processors, _follow(self.grammar, prompt)]
        return processors


def _follow(grammar: Matcher, prompt: int) -> LogitsProcessor:
    """generate_step's processor for a grammar: it consumes the tokens generated since its last call (the tokens
    it is shown are the `prompt` tokens read, then every token generated), then masks the logits."""
    consumed = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal consumed
        generated = tokens[prompt + consumed :].tolist() if tokens.size > prompt + consumed else []
        grammar.consume(generated)
        consumed += len(generated)
        return masked(logits, grammar.masks(()))

    return process
