"""The target's next-token policy, kept beside the states (`hidden_states.policy_top_k`, `policy_top_p`).

At every position t of a sample the target's distribution over the token at t + 1, from the final state through the
final norm and the LM head in the same forward as the states: its top k tokens (int32) and their log-probabilities
(float32, under the full softmax, not renormalised: the top k's mass stays known), sorted by probability. The nucleus
is cut as a server's sampler cuts it, top-k then top-p (ModelOpt's `deployment_policy`): the fewest of the k whose
probability, renormalised over the k, reaches top_p, the one that crosses it included; past it a slot keeps its
token and holds -inf (ModelOpt's convention: every row k wide). This is what an external draft trains on (ModelOpt's:
k = 20, top-p 0.95), at k * 8 bytes a token where the states cost 2 * (k + 1) * H. Temperature 1: the target's own
distribution.

Stored unshifted: row t is the policy FOR token t + 1. A trainer's file that lists the policy beside the token it
predicts shifts it by one (draftdata/hidden/modelopt.py); the last row predicts past the sample and is never exported.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_SLOT = 4 + 4  # an int32 token and a float32 log-probability
ROWS_PER_CHUNK = 1024  # logits are [rows, vocab] float32: 1,024 rows of a 150k vocabulary are 600 MB


@dataclass(frozen=True)
class PolicySpec:
    top_k: int
    top_p: float

    def describe(self) -> dict:
        return {
            "top_k": self.top_k,
            "top_p": self.top_p,
            "row": "row t is the target's policy for token t + 1 (from the logits at t)",
            "log_probs": "under the full softmax (not renormalised to the kept tokens)",
            "cut": "top-k then top-p: slots past the nucleus (cumulative probability over the k >= top_p) keep "
            "their token and hold -inf",
        }


def policy_spec(hs) -> PolicySpec | None:
    """`hidden_states`' policy settings; None where none is kept."""
    return PolicySpec(hs.policy_top_k, float(hs.policy_top_p)) if hs.policy_top_k else None


def bytes_per_token(top_k: int) -> int:
    return top_k * BYTES_PER_SLOT


def top_policy(logits, spec: PolicySpec):
    """(tokens int32 [T, k], log-probabilities float32 [T, k]) of logits [T, V]: the k likeliest tokens at every
    row, those past the nucleus at -inf."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    values, tokens = lp.topk(min(spec.top_k, lp.shape[-1]), dim=-1)  # sorted, likeliest first
    probs = values.exp()
    probs = probs / probs.sum(-1, keepdim=True)  # over the k, as top-k then top-p samples
    # a slot is kept while the probability before it is short of top_p: the token that crosses it stays in
    kept = (probs.cumsum(-1) - probs) < spec.top_p
    kept[..., 0] = True  # the likeliest token always: rounding must not cut a row empty
    values = torch.where(kept, values, torch.full_like(values, float("-inf")))
    return tokens.to(torch.int32), values


def policy_of(post_norm, lm_head, spec: PolicySpec, softcap: float | None = None):
    """The policy of one sample's post-norm final states [T, H] through the LM head, in chunks of rows so that the
    logits never take more than a chunk's memory; moved to the CPU."""
    import torch

    toks, lps = [], []
    for a in range(0, post_norm.shape[0], ROWS_PER_CHUNK):
        logits = lm_head(post_norm[a : a + ROWS_PER_CHUNK]).float()
        if softcap:  # Gemma's final_logit_softcapping, applied by its own forward after the head
            logits = torch.tanh(logits / softcap) * softcap
        t, v = top_policy(logits, spec)
        toks.append(t.cpu())
        lps.append(v.cpu())
    return torch.cat(toks), torch.cat(lps)
