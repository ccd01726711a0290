"""Mix the kit's jagged history encoder and GDPA interaction into a plain torchrec model.

Part 1 is an ordinary "DLRM-ish" torchrec model written without this kit: an ``EmbeddingBagCollection``
over user and item ids, a dense MLP, and an over-arch MLP producing a click logit.

Part 2 adds a user history (a ``KeyedJaggedTensor`` of item ids per user) to that model: a torchrec
``EmbeddingCollection`` embeds every history event (sharing the item table's ids, not its weights, to
keep the plain model untouched), :class:`~lightning_gem.components.JaggedHistoryEncoder` encodes the
jagged history, and :class:`~lightning_gem.components.GDPAInteraction` lets the item being scored attend
to it. Nothing is padded: the history stays ``[T, dim]`` with ``[B + 1]`` offsets end to end.

Both models train on the same synthetic clicks, whose probability depends on the item's popularity, a dense
feature and the items of the user's history; the script prints both models' held-out AUC side by side. Only the
model with the history can see its part.

Run: ``python examples/mix_into_torchrec.py`` (300 steps of 128 users; 11 minutes on 2 CPU cores shared with two busy
loops and a training run; held-out AUC 0.719 plain, 0.756 with the history).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning_gem.components import GDPAInteraction, JaggedHistoryEncoder
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_USERS, NUM_ITEMS, NUM_DENSE, EMB = 1000, 200, 8, 16


class PlainDLRM(nn.Module):
    """A plain torchrec model: pooled id embeddings + dense MLP -> over-arch -> one logit per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", num_embeddings=NUM_USERS, embedding_dim=EMB, feature_names=["user_id"]),
                EmbeddingBagConfig(name="item", num_embeddings=NUM_ITEMS, embedding_dim=EMB, feature_names=["item_id"]),
            ]
        )
        self.dense = nn.Sequential(nn.Linear(NUM_DENSE, 32), nn.ReLU(), nn.Linear(32, EMB))
        self.over = nn.Sequential(nn.Linear(3 * EMB, 32), nn.ReLU(), nn.Linear(32, 1))

    def features(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(sparse)  # KeyedTensor, [B, 2 * EMB]
        return torch.cat([self.dense(dense), pooled["user_id"], pooled["item_id"]], dim=1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.features(dense, sparse)).squeeze(1)


class DLRMWithHistory(PlainDLRM):
    """The same model plus a jagged user history, encoded by HSTU layers and read by the scored item."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.history_embeddings = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="history_item", num_embeddings=NUM_ITEMS, embedding_dim=EMB, feature_names=["history"]
                )
            ]
        )
        self.encoder = JaggedHistoryEncoder(input_dim=EMB, dim=dim, num_layers=2, num_heads=2, max_length=64)
        self.item_token = nn.Linear(EMB, dim)
        self.interaction = GDPAInteraction(dim, num_heads=2)
        self.over = nn.Sequential(nn.Linear(3 * EMB + dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor, history: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(sparse)
        events = self.history_embeddings(history)["history"]  # JaggedTensor: values [T, EMB]
        offsets = events.offsets().to(torch.int64)  # [B + 1]
        encoded = self.encoder(events.values(), offsets)  # [T, dim]
        # One candidate (the scored item) per user: candidate offsets are 0, 1, ..., B.
        batch_size = dense.shape[0]
        candidate_offsets = torch.arange(batch_size + 1, dtype=torch.int64)
        item = self.interaction(self.item_token(pooled["item_id"]), candidate_offsets, encoded, offsets)  # [B, dim]
        features = torch.cat([self.dense(dense), pooled["user_id"], pooled["item_id"], item], dim=1)
        return self.over(features).squeeze(1)


def make_world(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic world the batches come from: each item's popularity and taste, ``[NUM_ITEMS]`` each."""
    return torch.randn(NUM_ITEMS, generator=generator), torch.randn(NUM_ITEMS, generator=generator)


def random_batch(
    batch_size: int, world: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator
) -> tuple[torch.Tensor, KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor]:
    """A batch of users scoring one item each, with a click label drawn from a known model.

    ``P(click) = sigmoid(popularity[item] + 0.5 * dense[0] + 2 * mean(taste[history]) - 0.5)``: the plain model can
    learn the item's popularity and the dense feature; only a model that reads the history (0-39 events, empty
    ones included) sees how much of a clicker its user is. Users are drawn fresh, so their ids carry nothing.
    """
    popularity, taste = world
    dense = torch.randn(batch_size, NUM_DENSE, generator=generator)
    users = torch.randint(0, NUM_USERS, (batch_size,), generator=generator)
    lengths = torch.randint(0, 40, (batch_size,), generator=generator)
    history_items = torch.randint(0, NUM_ITEMS, (int(lengths.sum()),), generator=generator)
    owner = torch.repeat_interleave(torch.arange(batch_size), lengths)
    history_taste = torch.zeros(batch_size).index_add_(0, owner, taste[history_items]) / lengths.clamp_min(1)
    items = torch.randint(0, NUM_ITEMS, (batch_size,), generator=generator)
    logits = popularity[items] + 0.5 * dense[:, 0] + 2.0 * history_taste - 0.5
    labels = torch.bernoulli(torch.sigmoid(logits), generator=generator)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id", "item_id"],
        values=torch.cat([users, items]),
        lengths=torch.ones(2 * batch_size, dtype=torch.int64),
    )
    history = KeyedJaggedTensor.from_lengths_sync(keys=["history"], values=history_items, lengths=lengths)
    return dense, sparse, history, labels


def main(steps: int = 300, batch_size: int = 128) -> dict[str, float]:
    """Train both models on the same batches, then print (and return) their AUC on 4,096 held-out users."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    world = make_world(generator)
    plain, mixed = PlainDLRM(), DLRMWithHistory()
    opt_plain = torch.optim.Adam(plain.parameters(), lr=3e-3)
    opt_mixed = torch.optim.Adam(mixed.parameters(), lr=3e-3)
    for step in range(steps):
        dense, sparse, history, labels = random_batch(batch_size, world, generator)
        loss_plain = F.binary_cross_entropy_with_logits(plain(dense, sparse), labels)
        loss_mixed = F.binary_cross_entropy_with_logits(mixed(dense, sparse, history), labels)
        for loss, opt in ((loss_plain, opt_plain), (loss_mixed, opt_mixed)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(
                f"step {step:3d}  plain DLRM loss {loss_plain.item():.4f}  "
                f"with history encoder + GDPA {loss_mixed.item():.4f}"
            )
    dense, sparse, history, labels = random_batch(4096, world, generator)
    with torch.no_grad():
        auc = {
            "plain": float(binary_auroc(plain(dense, sparse), labels.long())),
            "mixed": float(binary_auroc(mixed(dense, sparse, history), labels.long())),
        }
    print(f"held-out AUC  plain DLRM {auc['plain']:.4f}  with history encoder + GDPA {auc['mixed']:.4f}")
    return auc


if __name__ == "__main__":
    main()
