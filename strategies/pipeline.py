"""Communication overlap: the embedding input all-to-all of the next batch runs under the current batch's compute.

torchrec's ``TrainPipelineSparseDist`` does this by owning the training loop and tracing the model with
``torch.fx``; a LightningModule's ``training_step`` (logging, Python control flow on shapes) is neither.
:class:`SparseDistPrefetcher` keeps Lightning's loop and does the same overlap from the data side:

* the loader is wrapped (:meth:`SparseDistPrefetcher.wrap`) so that, before batch ``i`` is handed to
  Lightning, batch ``i + 1`` is on the device and every sharded embedding module has started its
  ``input_dist`` (the id all-to-all: its lengths, then its values) on the ``KeyedJaggedTensor`` it will get;
* each sharded module's ``forward`` first looks for a started ``input_dist`` of the KJT it is called
  with (the same values storage) and then only runs ``compute_and_output_dist``; any other call runs
  the ordinary forward.

A KJT is matched to a module by its keys (the module's feature names). No batch is lost at an epoch's
end: the wrapper yields every batch of the loader, the last one without a successor. Batches changed
by ``on_before_batch_transfer`` / ``on_after_batch_transfer`` into new KJTs simply miss the prefetch.

On CUDA the prefetch works on a side stream, as torchrec's pipeline does: the batch's host-to-device copy,
the input_dist's small host-built tensors, the wait for the lengths all-to-all (whose split sizes the host
must read) and the per-key lengths of the ids received (which the lookup reads on the host) then wait only
for that stream's work, not for the compute stream's queue. On the compute stream every one of them is a
full drain: the host stops until the previous step has run, and the device idles while the host prepares
the next. The values all-to-all is launched when the module's forward needs it (its lengths are long done
by then); the compute stream waits for the side stream's work where it takes a prefetched batch or
input_dist, and their tensors are recorded as used by it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["SparseDistPrefetcher"]

_MAX_PENDING = 8  # started input_dists kept per module; older ones (batches never fed to the module) are dropped


def _kjts(batch: Any) -> list[Any]:
    """The ``KeyedJaggedTensor`` s of a batch: itself, the fields of a dataclass, or the values of a dict/sequence."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if isinstance(batch, KeyedJaggedTensor):
        return [batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, dict):
        items = list(batch.values())
    elif isinstance(batch, list | tuple):
        items = list(batch)
    else:
        return []
    return [item for item in items if isinstance(item, KeyedJaggedTensor)]


def _key(kjt: Any) -> tuple[int, int, int]:
    values, lengths = kjt.values(), kjt.lengths()
    return values.data_ptr(), values.numel(), lengths.data_ptr()


def _read_key_lengths(dist_input: Any) -> None:
    """Compute (and cache in each) the per-key lengths and offsets of the received KJTs (a ``KJTList`` or one
    KJT) now, on the side stream: the sharded lookup reads them on the host, which on the compute stream would
    wait for its whole queue."""
    features = getattr(dist_input, "features", None)
    for kjt in features if features is not None else [dist_input]:
        if hasattr(kjt, "offset_per_key"):
            kjt.offset_per_key()


class _Started:
    """One started input_dist: the KJT (kept alive so its storage is not reused), the context, the request."""

    def __init__(self, kjt: Any, ctx: Any, request: Any) -> None:
        self.kjt, self.ctx, self.request = kjt, ctx, request

    def result(self) -> Any:
        """Wait for the lengths all-to-all, launch the values one and wait for it (called once)."""
        return self.request.wait().wait()


class SparseDistPrefetcher:
    """Starts the sharded embedding modules' input all-to-all for upcoming batches (see the module docstring).

    Args:
        module: the model whose sharded torchrec modules (``paths``) are already in place.
        features: qualified module name -> the feature names (KJT keys) it looks up.
        move: moves a batch to the device (no Lightning hooks).
        stream: the CUDA side stream the prefetch works on; None: the current stream (CPU).
    """

    def __init__(
        self,
        module: nn.Module,
        features: dict[str, frozenset[str]],
        move: Callable[[Any], Any],
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.move = move
        self.stream = stream
        self.modules = {name: module.get_submodule(name) for name in features}
        self.features = dict(features)
        self.pending: dict[str, collections.OrderedDict[tuple[int, int, int], _Started]] = {
            name: collections.OrderedDict() for name in features
        }
        self.hits = 0
        """Forwards served by a started input_dist (for tests and logs)."""
        self.install()

    def install(self) -> None:
        """Route the sharded modules' forward through the prefetched input_dists (idempotent)."""
        for name, sharded in self.modules.items():
            sharded.forward = self._forward_of(name, sharded)  # instance attribute: the class is untouched

    def side(self) -> contextlib.AbstractContextManager[Any]:
        """The prefetch's stream as the current one (nothing on CPU)."""
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def hand_over(self, value: Any) -> None:
        """Let the current (compute) stream wait for the side stream's work so far, and record ``value``'s tensors
        (its ``record_stream``) as used by it, so their memory is not reused under it."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        record = getattr(value, "record_stream", None)
        if record is not None:
            record(current)

    def start(self, batch: Any) -> None:
        """Start the input_dist of every sharded module on its KJT in ``batch`` (on the side stream)."""
        with self.side():
            for kjt in _kjts(batch):
                keys = frozenset(kjt.keys())
                for name, sharded in self.modules.items():
                    if keys != self.features[name]:
                        continue
                    ctx = sharded.create_context()
                    pending = self.pending[name]
                    pending[_key(kjt)] = _Started(kjt, ctx, sharded.input_dist(ctx, kjt))
                    while len(pending) > _MAX_PENDING:
                        pending.popitem(last=False)

    def _forward_of(self, name: str, sharded: nn.Module) -> Callable[..., Any]:
        ordinary = type(sharded).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and not kwargs:
                started = self.pending[name].pop(_key(args[0]), None) if hasattr(args[0], "values") else None
                if started is not None and started.kjt.keys() == args[0].keys():
                    self.hits += 1
                    with self.side():
                        dist_input = started.result()
                        _read_key_lengths(dist_input)
                    self.hand_over(dist_input)
                    self.hand_over(started.ctx)
                    return sharded.compute_and_output_dist(started.ctx, dist_input)
            return ordinary(sharded, *args, **kwargs)

        return forward

    def wrap(self, loader: Any) -> _PrefetchingLoader:
        """``loader`` with every batch moved and its input_dist started one batch ahead."""
        return _PrefetchingLoader(loader, self)

    def remove(self) -> None:
        """Give the sharded modules their ordinary forward back and drop every started input_dist."""
        for sharded in self.modules.values():
            sharded.__dict__.pop("forward", None)
        for pending in self.pending.values():
            pending.clear()


class _PrefetchingLoader:
    """Iterates a loader one batch ahead; everything else (``len``, ``sampler``, ...) is the loader's."""

    def __init__(self, loader: Any, prefetcher: SparseDistPrefetcher) -> None:
        self.loader = loader
        self.prefetcher = prefetcher

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        upcoming = self._fetch(it)
        while upcoming is not None:
            current, upcoming = upcoming, self._fetch(it)
            self.prefetcher.hand_over(current[0])
            yield current[0]

    def _fetch(self, it: Iterator[Any]) -> tuple[Any] | None:
        try:
            batch = next(it)
        except StopIteration:
            return None
        with self.prefetcher.side():
            batch = self.prefetcher.move(batch)
        self.prefetcher.start(batch)
        return (batch,)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "prefetcher"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)
