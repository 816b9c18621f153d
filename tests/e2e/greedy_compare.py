"""Comparing two greedy runs of the same prompts whose numerics differ slightly (bf16 vs
fp32, graph replay vs eager): vLLM's ``check_logprobs_close`` idea, as numbers the tests
assert on."""

from __future__ import annotations

Run = tuple[list[int], list[dict[int, float]]]  # token ids, per step {token: logprob}


def compare_greedy(got: list[Run], ref: list[Run],
                   ) -> tuple[int, list[float], list[tuple[int, int, bool, bool]]]:
    """Per prompt, find where the two token sequences first differ.  Returns the number
    of identical sequences; the chosen tokens' logprob differences while the two agree
    (pooled); and per diverging prompt ``(prompt, index, got's token in ref's top-k,
    ref's token in got's top-k)``."""
    identical, diffs, flips = 0, [], []
    for p, ((g_ids, g_lp), (r_ids, r_lp)) in enumerate(zip(got, ref, strict=True)):
        j = next((i for i, (a, b) in enumerate(zip(g_ids, r_ids)) if a != b), None)
        identical += j is None
        diffs += [abs(g_lp[i][g_ids[i]] - r_lp[i][r_ids[i]])
                  for i in range(len(g_ids) if j is None else j)]
        if j is not None:
            flips.append((p, j, g_ids[j] in r_lp[j], r_ids[j] in g_lp[j]))
    return identical, diffs, flips
