"""Multi-task prediction heads: one MLP tower per task, logits ``[C, num_tasks]``.

Legend: ``C`` candidates (impressions) over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MultiTaskHead"]

_LN2 = math.log(2.0)


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler, 2012)."""
    return torch.where(x > -_LN2, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class MultiTaskHead(nn.Module):
    """Per-task MLP towers over shared candidate representations.

    Every column of the output is a logit trained with binary cross-entropy against the label column
    of the same task. Labels per task:

    - ``esmm=False``: each task's label is its own event over all impressions, e.g. ``ctr``: clicked;
      ``cvr``: converted (as the data defines it; if conversions are only defined after a click, train
      ``cvr`` on clicked rows only, or use ``esmm=True``).
    - ``esmm=True`` (Ma et al., 2018, Entire Space Multi-task Model): the ``cvr_task`` column is the logit
      of ``pCTCVR = pCTR * pCVR`` and its label must be **click AND conversion** over all impressions,
      so the post-click pCVR tower is trained over the entire impression space without selection bias.
      The ``ctr_task`` column is pCTR (label: clicked). Get the post-click pCVR itself from
      :meth:`tower_logits`.

    Args:
        input_dim: width of the candidate representations.
        tasks: task names, in label-column order.
        hidden_dims: hidden widths of each tower's MLP (SiLU between layers).
        dropout: dropout after each hidden layer.
        esmm: combine ``ctr_task`` and ``cvr_task`` as above.
        ctr_task: name of the click task (for ``esmm``).
        cvr_task: name of the conversion task (for ``esmm``).

    Shapes:
        x ``[C, input_dim]`` -> logits ``[C, len(tasks)]``.

    Example:
        >>> import torch
        >>> head = MultiTaskHead(16, tasks=("ctr", "cvr"), hidden_dims=(8,), esmm=True)
        >>> logits = head(torch.randn(4, 16))
        >>> logits.shape
        torch.Size([4, 2])
        >>> bool((torch.sigmoid(logits[:, 1]) <= torch.sigmoid(logits[:, 0]) + 1e-6).all())  # pCTCVR <= pCTR
        True
    """

    def __init__(
        self,
        input_dim: int,
        tasks: Sequence[str] = ("ctr", "cvr"),
        hidden_dims: Sequence[int] = (64,),
        *,
        dropout: float = 0.0,
        esmm: bool = False,
        ctr_task: str = "ctr",
        cvr_task: str = "cvr",
    ) -> None:
        super().__init__()
        tasks = tuple(tasks)
        if input_dim < 1:
            raise ValueError(f"`input_dim` must be >= 1, got {input_dim}")
        if not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"`tasks` must be non-empty and unique, got {tasks}")
        if any(not t or "." in t for t in tasks):
            raise ValueError(f"task names must be non-empty and contain no '.', got {tasks}")
        if any(h < 1 for h in hidden_dims):
            raise ValueError(f"`hidden_dims` must be >= 1, got {tuple(hidden_dims)}")
        if esmm and (ctr_task not in tasks or cvr_task not in tasks):
            raise ValueError(f"esmm=True needs tasks {ctr_task!r} and {cvr_task!r} in `tasks`, got {tasks}")
        self.tasks = tasks
        self.esmm = esmm
        self._ctr = tasks.index(ctr_task) if esmm else -1
        self._cvr = tasks.index(cvr_task) if esmm else -1
        self.towers = nn.ModuleDict({task: self._tower(input_dim, hidden_dims, dropout) for task in tasks})

    @staticmethod
    def _tower(input_dim: int, hidden_dims: Sequence[int], dropout: float) -> nn.Sequential:
        layers: list[nn.Module] = []
        width = input_dim
        for hidden in hidden_dims:
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, 1))
        return nn.Sequential(*layers)

    def tower_logits(self, x: Tensor) -> Tensor:
        """Raw tower logits ``[C, num_tasks]``; with ``esmm`` the cvr column is the post-click pCVR logit.

        Each tower's last Linear runs in fp32 whatever the autocast state: bf16 logits (8 significant bits) would
        tie many predictions in AUC and round the loss's logits; the layer is ``width x 1``, so it costs nothing.
        """
        if x.dim() != 2:
            raise ValueError(f"`x` must be [C, input_dim], got shape {tuple(x.shape)}")
        columns = []
        for tower in self.towers.values():
            *body, last = tower  # not tower[:-1], which builds a new Sequential every call
            hidden = x
            for layer in body:
                hidden = layer(hidden)
            with torch.autocast(hidden.device.type, enabled=False):  # the weight's dtype: fp32 unless cast (FSDP2)
                columns.append(last(hidden.to(last.weight.dtype)))
        return torch.cat(columns, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[C, num_tasks]`` to train with BCE against labels ``[C, num_tasks]`` (see class doc)."""
        logits = self.tower_logits(x)
        if not self.esmm:
            return logits
        # logit(sigmoid(a) * sigmoid(b)) computed in log space; capped so p < 1 keeps the logit finite.
        log_p = (F.logsigmoid(logits[:, self._ctr]) + F.logsigmoid(logits[:, self._cvr])).clamp_max(-1e-7)
        ctcvr = log_p - _log1mexp(log_p)
        columns = list(logits.unbind(1))
        columns[self._cvr] = ctcvr
        return torch.stack(columns, dim=1)
