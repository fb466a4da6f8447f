"""Two prefill pieces in flight: piece p + 1 enters layer i once piece p has left it.

On a board a layer is NPU work (stage graphs, attention's and the experts' matmuls) around
CPU work (KDA chunks, softmax, routing, the experts' activations), and one piece walks
through them in turn: the NPU idles while the CPU works and the other way round. The
sequence state only orders pieces per layer (layer i's KDA state, conv tail and latent
rows after piece p are what piece p + 1 reads in layer i), so a second piece can run one
layer behind the first and fill each side's idle time with its own work: a wavefront over
(piece, layer). The arithmetic of every piece is the one a call per piece would do, in the
same order per layer: the results are the same bits (tests/test_model_pipeline.py), as long
as each piece would have taken the same MLA form (the expanded or absorbed choice is made
once per call: a one-token last piece runs expanded here, absorbed as a call of its own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

# One piece's walk through the layers: (piece index, before layer i, after layer i) ->
# its last hidden states. ``before`` blocks until the piece ahead has left layer i.
PieceRun = Callable[[int, Callable[[int], None], Callable[[int], None]], np.ndarray]


class Abandoned(Exception):
    """The piece ahead failed: this one stops at its next layer."""


def run_wavefront(pieces: int, layers: int, run: PieceRun, pool: ThreadPoolExecutor
                  ) -> tuple[list[np.ndarray], float]:
    """Each piece's result, pieces run on ``pool`` (two threads: two pieces in flight),
    and the overlap: the seconds the pieces ran minus the seconds it took (what running
    them in turn would have added). Raises the first failure after every piece has
    stopped, so nothing still writes to the state when the caller sees it."""
    clock = time.perf_counter
    started = clock()
    busy = [0.0] * pieces
    done = [[threading.Event() for _ in range(layers)] for _ in range(pieces)]
    failed = threading.Event()

    def walk(p: int) -> np.ndarray:
        def before(i: int) -> None:
            if p:
                done[p - 1][i].wait()
            if failed.is_set():
                raise Abandoned

        def after(i: int) -> None:
            done[p][i].set()

        t0 = clock()
        try:
            return run(p, before, after)
        except BaseException:
            failed.set()
            for event in done[p]:
                event.set()  # the piece behind wakes and sees the failure
            raise
        finally:
            busy[p] = clock() - t0

    # FIFO: piece p + 2 starts only when p has finished, so a waiting piece's predecessor
    # is always running or done (no deadlock with two threads)
    futures: list[Future[np.ndarray]] = [pool.submit(walk, p) for p in range(pieces)]
    results: list[np.ndarray] = []
    first: BaseException | None = None
    for f in futures:
        try:
            results.append(f.result())
        except Abandoned:
            pass
        except BaseException as exc:  # re-raised below, once every piece has stopped
            first = first or exc
    if first is not None:
        raise first
    return results, sum(busy) - (clock() - started)
