"""What a GDPA call hands to an implementation besides its data: :class:`Spec`, and the same fields as op arguments.

:func:`lightning_gem.ops.gdpa` validates its arguments once and passes them on as one :class:`Spec`; the
implementations (reference, padded, Triton, FlashAttention-4) and their launchers take it whole instead of a dozen
keywords each. The custom ops take the same fields flat (the dispatcher passes tensors and scalars only), in the
same order, so ``op(q, k, v, *spec)`` calls one and ``Spec(*args)`` rebuilds the spec inside it.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, get_type_hints

from torch import Tensor

__all__ = ["HINTS_SCHEMA", "MODE_SCHEMA", "Spec", "op_signature", "with_length_hints"]


class Spec(NamedTuple):
    """One GDPA call but its ``q``, ``k``, ``v`` (the arguments of :func:`lightning_gem.ops.gdpa`, validated).

    ``q_offsets [B + 1]`` / ``kv_offsets [Bkv + 1]`` cut the query and kv segments (``kv_offsets`` is
    ``q_offsets`` itself for self-attention), ``kv_index [B]`` names each query segment's kv segment (None: its
    own), ``num_targets [B]`` counts the targets ending each segment (None: none). ``activation``, ``causal``,
    ``window`` and ``block_size`` decide what is computed over which pairs (:mod:`.masks`), ``scale`` multiplies
    the scores. ``max_seq_len_q`` / ``max_seq_len_kv`` bound the segment lengths (None: unknown; the kernels need
    them and their launchers fill them in), ``deterministic`` asks for bitwise reproducible gradients, ``precision``
    ``"fp8"`` for the forward's products on FP8 codes (:mod:`.fp8`; None: in the inputs' dtype).
    """

    q_offsets: Tensor
    kv_offsets: Tensor
    kv_index: Tensor | None
    num_targets: Tensor | None
    activation: str
    causal: bool
    window: int | None
    block_size: int | None
    scale: float
    max_seq_len_q: int | None = None
    max_seq_len_kv: int | None = None
    deterministic: bool = False
    precision: str | None = None


# Spec's fields as a custom op's schema arguments: the offsets, index and targets and the mode (the first nine,
# what the reference op takes after q, k, v), then the length hints, ``deterministic`` and ``precision`` (the kernels'
# ops).
MODE_SCHEMA = (
    "Tensor q_offsets, Tensor kv_offsets, Tensor? kv_index, Tensor? num_targets, str activation, bool causal, "
    "SymInt? window, SymInt? block_size, float scale"
)
HINTS_SCHEMA = "SymInt max_seq_len_q, SymInt max_seq_len_kv, bool deterministic, str? precision"


def op_signature(before: dict[str, object], after: dict[str, bool], returns: object) -> inspect.Signature:
    """The signature a ``torch.library.triton_op`` infers its schema from, for a body ``fn(*before, *spec, *after)``:
    the arguments ``before`` (name to annotation), every :class:`Spec` field as :class:`Spec` annotates it (and
    with its default) but the length hints, which the ops take filled in (:func:`with_length_hints`), then the flags
    ``after`` (name to default), returning ``returns``. Set as the body's ``__signature__`` it declares the fields
    once, here, instead of in every op's parameter list."""
    hints = {"max_seq_len_q": int, "max_seq_len_kv": int}
    annotations = before | get_type_hints(Spec) | hints | dict.fromkeys(after, bool)
    defaults = {name: value for name, value in Spec._field_defaults.items() if name not in hints} | after
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [
        inspect.Parameter(name, kind, annotation=annotation, default=defaults.get(name, inspect.Parameter.empty))
        for name, annotation in annotations.items()
    ]
    return inspect.Signature(parameters, return_annotation=returns)


def with_length_hints(spec: Spec, q: Tensor, k: Tensor) -> Spec:
    """``spec`` with the length hints it lacks read from its offsets (:func:`lightning_gem.jagged.max_length_hint`:
    one device sync in eager mode, once per offsets tensor (:func:`.impl.derived.longest_segment`); the token count
    under ``torch.compile``); ``spec`` itself when it has both."""
    max_q, max_kv = spec.max_seq_len_q, spec.max_seq_len_kv
    if max_q is not None and max_kv is not None:
        return spec
    # Imported here: it loads Triton, which importing the kit must not.
    from lightning_gem.ops.attention.impl.derived import longest_segment

    if max_q is None:
        max_q = longest_segment(spec.q_offsets, q.shape[0])
    if max_kv is None:
        max_kv = longest_segment(spec.kv_offsets, k.shape[0])
    return spec._replace(max_seq_len_q=max_q, max_seq_len_kv=max_kv)
