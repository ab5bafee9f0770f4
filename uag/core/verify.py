"""Verification: which proposed tokens the target keeps, and the token it adds. Every acceptance rule
uag uses is here.

- Greedy and exact-match sampling (`accept_greedy`): the target chooses a token at every proposed
  position (argmax, or a sample at temperature > 0); the proposal is kept up to the first position where
  the target chose otherwise, and the target's own choice there is the next token. Pure.
- Rejection sampling over a token-level intersection (`accept_rejection`, TLI at temperature > 0): the
  drafter samples x_i from q_i (its distribution restricted to tokens the target also has); the target
  accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection it samples from the
  residual max(0, p_i − q_i) renormalised; if every draft is accepted it samples a bonus token from p_n.
  Each emitted token is then distributed exactly as the target alone would sample it (Leviathan et al.
  2023; Chen et al. 2023), with q carried into the target's vocabulary through the id mapping. p is the
  distribution the target alone samples from: after its penalties, top_p, min_p and top_k
  (uag.core.sampling.TargetSampling.distribution).

- Several proposals in one pass (`Tree`, `accept_tree`): the proposals merged into a trie, verified in one pass
  under a tree mask (uag.core.passes.tree_pass); from the root, the child whose token is the target's choice at its
  parent's row is followed, so every committed token is still the target's own choice (greedy or sampled). Pure.

Either way a cycle commits `accepted` proposed tokens plus one token of the target's own: the output is
the target's, token for token (greedy) or in distribution (sampling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one verification pass."""

    accepted: int  # leading proposed tokens the target kept
    token: int  # the target's own next token (the correction, or the bonus when all were kept)

    def committed(self, proposed: Sequence[int]) -> list[int]:
        """The tokens this verification commits. Example: proposed [5, 6, 7], accepted 2, token 9 -> [5, 6, 9]"""
        return [*proposed[: self.accepted], self.token]


def accept_greedy(proposed: Sequence[int], choices: Sequence[int]) -> Verdict:
    """Keep the proposal up to the first position where the target chose otherwise.

    `choices[i]` is the target's token after the committed text and proposed[:i] (len(proposed) + 1 of them).
    Example: proposed [5, 6, 7], choices [5, 6, 9, 4] -> Verdict(accepted=2, token=9)
             proposed [5, 6],    choices [5, 6, 8]    -> Verdict(accepted=2, token=8)   (all kept, bonus 8)
    """
    n = 0
    for x, y in zip(proposed, choices):
        if x != y:
            break
        n += 1
    return Verdict(n, int(choices[n]))


@dataclass(frozen=True, slots=True)
class Tree:
    """Several proposals after one pending token, merged into a trie (shared prefixes verified once), its nodes in
    depth-first order: the order a tree pass reads them in, after the pending token (the root, row 0).

    Example: Tree.of([[5, 6, 7], [5, 8]]) -> tokens [5, 6, 7, 8], parents [-1, 0, 1, 0], depths [1, 2, 3, 2],
             paths [[0, 1, 2], [0, 3]]
    """

    tokens: list[int]  # each node's token
    parents: list[int]  # each node's parent node; -1: the root
    depths: list[int]  # each node's distance from the root (its position after the pending token)
    paths: list[list[int]]  # each proposal as the nodes it runs through, in the order given

    @classmethod
    def of(cls, proposals: Sequence[Sequence[int]]) -> Tree:
        trie: dict = {}  # token -> (its subtrie), children in the order first proposed
        for proposal in proposals:
            node = trie
            for token in proposal:
                node = node.setdefault(token, {})
        tokens, parents, depths, index = [], [], [], {}

        def walk(node: dict, parent: int, depth: int, prefix: tuple[int, ...]) -> None:
            for token, children in node.items():
                index[(*prefix, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                depths.append(depth)
                walk(children, len(tokens) - 1, depth + 1, (*prefix, token))

        walk(trie, -1, 1, ())
        paths = [[index[tuple(p[: i + 1])] for i in range(len(p))] for p in proposals]
        return cls(tokens, parents, depths, paths)

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self) -> list[list[bool]]:
        """Which rows of a tree pass each row sees, the root's row 0 and node i's row i + 1: itself and its
        ancestors (the committed text before the root, all visible, is not in it).

        Example: Tree.of([[5], [6]]).mask() -> [[T, F, F], [T, T, F], [T, F, T]]  (the two branches blind to each other)
        """
        rows = [[True] + [False] * len(self)]
        for i, parent in enumerate(self.parents):
            row = list(rows[parent + 1])
            row[i + 1] = True
            rows.append(row)
        return rows


@dataclass(frozen=True, slots=True)
class TreeVerdict:
    """The outcome of a tree pass: the nodes kept (root's child first), the target's own next token, and the
    proposal they lie on (the first given, where several share them), and how many nodes the pass read."""

    path: list[int]
    token: int
    branch: int
    nodes: int = 0

    @property
    def verdict(self) -> Verdict:
        return Verdict(len(self.path), self.token)


def accept_tree(tree: Tree, choices: Sequence[int]) -> TreeVerdict:
    """Walk from the root, following the child whose token is the target's choice at its parent's row, until no
    child holds it: that choice is the target's next token. `choices[0]` is the root's (the pending token's row),
    `choices[i + 1]` node i's. Following a child only where it equals the target's draw from that row commits
    exactly what the target alone would: greedy or sampled, each row is drawn once, by the target.

    Example: Tree.of([[5, 6], [7, 8]]), choices [7, 0, 0, 8, 3] -> path [2, 3], token 3, branch 1, nodes 4
    """
    path, row = [], 0
    while True:
        parent = path[-1] if path else -1
        child = next((i for i, p in enumerate(tree.parents) if p == parent and tree.tokens[i] == choices[row]), None)
        if child is None:
            break
        path.append(child)
        row = child + 1
    branch = next(b for b, nodes in enumerate(tree.paths) if nodes[: len(path)] == path)
    return TreeVerdict(path, int(choices[row]), branch, len(tree))


class IdMap:
    """Drafter id → target id mapping as index arrays, for scattering drafter probabilities."""

    def __init__(self, to_target: dict[int, int], drafter_size: int):
        drafter_ids = sorted(to_target)
        self.drafter_ids = mx.array(drafter_ids)
        self.target_ids = mx.array([to_target[d] for d in drafter_ids])
        allowed = mx.zeros((drafter_size,), dtype=mx.bool_)
        allowed[self.drafter_ids] = True
        # Added to the drafter's logits: tokens the target lacks can never be drafted.
        self.drafter_mask = mx.where(allowed, 0.0, -mx.inf)

    def to_target_space(self, q: mx.array, target_size: int) -> mx.array:
        """A drafter distribution as a distribution over target ids (several drafter ids may share one)."""
        return mx.zeros((target_size,), dtype=q.dtype).at[self.target_ids].add(q[self.drafter_ids])


def draft_distribution(masked_logits: mx.array, temperature: float) -> mx.array:
    """q: the drafter's distribution over the intersection (logits already masked) at the temperature."""
    return mx.softmax(masked_logits.astype(mx.float32) / temperature, axis=-1)


def accept_rejection(
    p: mx.array, q: mx.array, drafts: Sequence[int], proposed: Sequence[int], id_map: IdMap
) -> Verdict:
    """Rejection sampling for one cycle. p: (n + 1, V_target), the target's distribution at each position;
    q: (n, V_drafter), the drafter's, from which `drafts` were sampled (`proposed`: them as target ids)."""
    n = len(proposed)
    accepted = 0
    if n:
        rows = mx.arange(n)
        p_x = p[rows, mx.array(list(proposed))]
        q_x = q[rows, mx.array(list(drafts[:n]))]
        u = mx.random.uniform(shape=(n,))
        keep = (u * q_x < p_x).tolist()  # u < p/q, without dividing by q
        accepted = next((i for i, ok in enumerate(keep) if not ok), n)
    if accepted == n:
        return Verdict(accepted, mx.random.categorical(mx.log(p[n])).item())
    residual = mx.maximum(p[accepted] - id_map.to_target_space(q[accepted], p.shape[-1]), 0.0)
    if residual.sum().item() <= 0:  # p ≤ q everywhere happens only through rounding
        residual = p[accepted]
    return Verdict(accepted, mx.random.categorical(mx.log(residual)).item())
