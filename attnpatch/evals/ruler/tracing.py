"""Variable tracking (RULER's multi-hop tracing task): chains of ``VAR X = ...`` assignments
interleaved with a haystack, after a one-shot example -- prompt template and the sample builder."""

from __future__ import annotations

import string

from .haystack import Haystack, get_haystack

__all__ = ["VT_TEMPLATE", "VT_ANSWER_PREFIX", "VT_NUM_CHAINS", "VT_NUM_HOPS"]

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's own spelling, kept so prompts match the published ones.
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assgined the value {query}, they are: "
)
VT_NUM_CHAINS = 1
VT_NUM_HOPS = 4


def _vt_chains(rng, num_chains: int, num_hops: int, name_len: int):
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < num_chains * (num_hops + 1):
        v = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if v not in seen:
            seen.add(v)
            names.append(v)
    values = rng.sample(range(10000, 100000), num_chains)
    chains, chain_vars = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        stmts = [f"VAR {vs[0]} = {values[c]}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]}" for j in range(num_hops)]
        chains.append(stmts)
        chain_vars.append(vs)
    return chain_vars, chains, [str(v) for v in values]


def _vt_inserts(rng, chains):
    inserts = []
    for stmts in chains:
        fr = sorted(rng.random() for _ in stmts)
        inserts.extend(zip(fr, stmts))
    inserts.sort(key=lambda t: t[0])  # stable: a chain's statements stay in order on ties
    return inserts


def vt_builder(rng, hay: Haystack):
    # one-shot example as in RULER: a short noise context, 3-letter variable names
    ex_vars, ex_chains, ex_values = _vt_chains(rng, 1, VT_NUM_HOPS, 3)
    ex_hay = get_haystack("repeat")
    ex_context = ex_hay.render(ex_hay.take(5 * len(ex_hay.units[0])), _vt_inserts(rng, ex_chains))
    example = (
        VT_TEMPLATE.format(context=ex_context, query=ex_values[0])
        + VT_ANSWER_PREFIX.format(num_v=VT_NUM_HOPS + 1, query=ex_values[0])
        + " ".join(ex_vars[0])
    )
    chain_vars, chains, values = _vt_chains(rng, VT_NUM_CHAINS, VT_NUM_HOPS, 5)
    inserts = _vt_inserts(rng, chains)
    start = rng.randrange(len(hay.units))
    answers = list(chain_vars[0])
    answer_prefix = VT_ANSWER_PREFIX.format(num_v=len(answers), query=values[0])

    def build(n: int):
        context = hay.render(hay.take(n, start), inserts)
        return example + "\n\n" + VT_TEMPLATE.format(context=context, query=values[0]), answer_prefix

    return 16, None, build, answers
