"""The source text of a throwaway method file (exact attention with the logits times ``factor``), for the
tests that show a new method is one new file: they write it into a temporary package and discover it."""

_SOURCE = '''
"""A throwaway method: exact attention with the logits multiplied by ``factor`` (1.0 = exact), through SDPA."""

from dataclasses import dataclass, field

import torch.nn.functional as F

from attnpatch.options import check_fields, opt, options_of
from attnpatch.patchers.registry import ExactLimit, Method, register_method
from attnpatch.patchers.state import LayerRecord


@dataclass(frozen=True)
class ScaledConfig:
    factor: float = field(default=1.0, metadata=opt("float", "multiplier of the attention logits", low=0.0, low_open=True))

    def __post_init__(self):
        check_fields(self)


def forward(cfg, q, k, v, ctx):
    lq, lk = q.shape[2], k.shape[2]
    if ctx.key_valid is not None or ctx.q_offset != 0 or lq != lk:
        return None, LayerRecord(ctx.layer, "dense:layout", lq, lk)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=ctx.causal, scale=ctx.scale * cfg.factor,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out, LayerRecord(ctx.layer, "scaled", lq, lk)


def one(tokens):
    return {"factor": 1.0}


register_method(Method(
    name=__NAME__, summary="logits times factor, through SDPA (a test method)", source="a test",
    options=options_of(ScaledConfig), model_kinds=frozenset({"causal_lm", "vision"}),
    make_config=lambda o: ScaledConfig(**o), forward=forward, exact_limit_decl=ExactLimit(one, text="factor = 1"),
    small_settings={"causal_lm": {"factor": 0.5}, "vision": {"factor": 0.5}},
))
'''


def scaled_dense_source(name: str, **breakage: bool) -> str:
    """The text of a method file that registers the method ``name`` (model kinds: causal LMs and ViTs).

    ``breakage`` makes it wrong in one way, for tests that the checks catch it: ``bidirectional``
    (causal calls attend to later keys), ``ignore_padding`` (padding keys attended), ``layout``
    (returns ``[B, Lq, H, D]``), ``bad_calls`` (declares that it takes no causal calls).
    """
    src = _SOURCE.replace("__NAME__", repr(name))
    if breakage.pop("bidirectional", False):
        src = src.replace("is_causal=ctx.causal", "is_causal=False")
    if breakage.pop("ignore_padding", False):
        src = src.replace("ctx.key_valid is not None or ", "")
    if breakage.pop("layout", False):
        src = src.replace('return out, LayerRecord(ctx.layer, "scaled", lq, lk)', 'return out.transpose(1, 2), LayerRecord(ctx.layer, "scaled", lq, lk)')
    if breakage.pop("bad_calls", False):
        src = src.replace("forward=forward,", "forward=forward, causal_calls=False,")
    assert not breakage, breakage
    return src
