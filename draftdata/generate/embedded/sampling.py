"""Sampling for slot batching: transformers' temperature, top-k and top-p, and a seeded Gumbel-max draw.

transformers' continuous batching sorts the whole vocabulary of every row for top-p (a 49k-token sort per request
per step). Here the cut is made on the `TOP_CANDIDATES` most likely tokens, which hold the top-p mass in practice;
the rows whose cut lies beyond them are cut together on the `WIDER` most likely, and a row whose cut lies beyond
those too is sorted whole, so the result is exact either way.

A seeded draw's noise is a hash of (seed + position, token id): a token's own, not a rank's among the candidates,
and computed for the candidates only, where a generator's stream over the whole vocabulary per row (as transformers'
path draws it) costs many times more (docs/benchmarks.md, the embedded engine).
"""

from __future__ import annotations

from dataclasses import dataclass

TOP_CANDIDATES = 256
WIDER = 4096  # the candidates of the rows whose top-p cut lies past TOP_CANDIDATES, before a whole-row sort
_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int  # <= 0: off


def sample(logits, sampling: Sampling, seeds: list[int | None], positions: list[int]) -> list[int]:
    """One token per row of `logits` [B, V] (float32): greedy at temperature 0, else temperature, top-k and top-p
    as transformers applies them, then a Gumbel-max draw among the tokens kept. A row with a seed draws with noise
    keyed by (seed + its sequence position): the token at a position is the same whatever the batch, an eviction
    or a restart. The candidates are the `TOP_CANDIDATES` most likely tokens, which hold the top-p cut
    in practice; rows whose cut lies beyond them are cut on `WIDER`, and past those sorted whole."""
    import torch

    if sampling.temperature == 0:
        return logits.argmax(dim=-1).tolist()
    scores = logits / sampling.temperature
    vocab = scores.shape[-1]
    everything = sampling.top_k <= 0 and sampling.top_p >= 1.0
    k = vocab if everything else min(vocab, sampling.top_k if sampling.top_k > 0 else TOP_CANDIDATES)
    vals, idx = _candidates(scores, k, sampling)
    tokens = _gumbel_max(vals, idx, seeds, positions)
    if k < vocab and sampling.top_k <= 0:  # rows whose top-p cut is not inside the candidates
        rows = torch.nonzero(vals[:, -1] > float("-inf")).flatten().tolist()
        if not rows:
            return tokens
        # first all of them at once among WIDER candidates (a flat row at temperature 0.8: about one row in sixty
        # on SmolLM2), the same draw as over the whole row wherever their cut lies inside those
        wide = min(vocab, WIDER)
        w_vals, w_idx = _candidates(scores[rows], wide, sampling)
        drawn = _gumbel_max(w_vals, w_idx, [seeds[r] for r in rows], [positions[r] for r in rows])
        beyond = set()
        for j, row in enumerate(rows):
            if wide < vocab and w_vals[j, -1] > float("-inf"):
                beyond.add(row)
            else:
                tokens[row] = drawn[j]
        for row in sorted(beyond):  # still beyond: sorted whole
            r_vals, r_idx = _candidates(scores[row : row + 1], vocab, sampling)
            kept = r_vals[0] > float("-inf")  # noise for the kept tokens only (the rest cannot win): a hash per token
            r_vals, r_idx = r_vals[:, kept], r_idx[:, kept]
            tokens[row] = _gumbel_max(r_vals, r_idx, seeds[row : row + 1], positions[row : row + 1])[0]
    return tokens


def _candidates(scores, k: int, sampling: Sampling):
    """The k most likely tokens per row, most likely first ([B, k] scores and ids), the ones top-k and top-p cut
    set to -inf (top-p keeps a token while the mass of the tokens above it is under top_p, as transformers does;
    with top-k too, the mass is over the top-k tokens)."""
    import torch

    if k == scores.shape[-1] and sampling.top_p >= 1.0 and sampling.top_k <= 0:
        return scores, torch.arange(k).expand_as(scores)
    vals, idx = scores.topk(k, dim=-1)
    if sampling.top_k > 0:
        vals = vals.masked_fill(vals < vals[:, -1:], float("-inf"))
    if sampling.top_p < 1.0:
        # top-p's mass is over what top-k kept (transformers renormalizes after its top-k), else the whole vocabulary
        mass = vals if sampling.top_k > 0 else scores
        probs = (vals - torch.logsumexp(mass, dim=-1, keepdim=True)).exp()
        vals = vals.masked_fill(probs.cumsum(dim=-1) - probs >= sampling.top_p, float("-inf"))
    return vals, idx


def _gumbel_max(vals, idx, seeds: list[int | None], positions: list[int]) -> list[int]:
    """Gumbel-max: the kept token with the largest score plus Gumbel noise, a draw from their softmax. A token's
    noise is keyed by its id, not by its rank among the candidates: a rounding (another batch, a continuation's
    prefill, 16-bit arithmetic) that reorders two near-equal candidates would hand noise dealt by rank to other
    tokens and change the draw; noise keyed by id changes it only where the rounding tips the winner."""
    import torch

    gen = torch.Generator()  # an unseeded row's key: a fresh nondeterministic seed
    keys = [(gen.seed() if seed is None else seed + pos) & 0x7FFFFFFF for seed, pos in zip(seeds, positions)]
    noise = _gumbel(torch.tensor(keys, dtype=torch.int64), idx)
    choice = (vals + noise).argmax(dim=-1, keepdim=True)
    return idx.gather(-1, choice).flatten().tolist()


def _gumbel(keys, ids):
    """Standard Gumbel noise [B, K] for token ids [B, K], a function of (the row's key, the token id) alone."""
    import torch

    bits = _mix((_mix(keys)[:, None] + ids) & _MASK)
    uniform = ((bits >> 9).float() + 0.5) / 2**23  # 23 bits, exact in float32, strictly inside (0, 1)
    return -torch.log(-torch.log(uniform))


def _mix(x):
    """A 32-bit integer hash (lowbias32's shape) on int64 tensors; multipliers under 2**31, so that a product of a
    32-bit value stays under 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK
    return x ^ (x >> 16)
