"""Requests to an engine behind HTTP, one thread each: the part SGLangEngine and VLLMEngine share.

Each request runs `generate(request) -> Completion` (one streaming HTTP call) on a thread of its own for
its whole stream, so the pool's size caps the requests in flight at the server; the rest wait in the
pool's queue. `finished()` hands back what ended since the last call, re-raising a request's error.

`pinned_view` is an evaluation's view of such an engine (megarl/eval/sampler_side.py): the same server, a
pool of its own, so the sampler's evaluation and its training requests never collect each other's completions.
"""
from __future__ import annotations

import copy
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from megarl.protocols import Completion, GenerationRequest

STEP_POLL_S = 0.05  # finished() waits this long for a finished request before returning none


class RequestPool:
    def __init__(self, max_running: int, name: str):
        self.max_running = max_running
        self._pool = ThreadPoolExecutor(max_workers=max_running, thread_name_prefix=f"megarl-{name}-generate")
        self._finished: queue.Queue[Future] = queue.Queue()
        self.unfinished = 0
        self.counts = {"tokens_decoded": 0, "requests_finished": 0}

    def submit(self, generate: Callable[[GenerationRequest], Completion], request: GenerationRequest) -> None:
        future = self._pool.submit(generate, request)
        future.add_done_callback(self._finished.put)
        self.unfinished += 1

    def finished(self) -> list[Completion]:
        """The requests finished since the last call (waits up to STEP_POLL_S for one while any runs)."""
        done = []
        try:
            done.append(self._finished.get(timeout=STEP_POLL_S if self.unfinished else 0))
            while True:
                done.append(self._finished.get_nowait())
        except queue.Empty:
            pass
        completions = []
        for future in done:
            self.unfinished -= 1
            completion = future.result()  # re-raises the request's error (the engine's, naming its server)
            self.counts["tokens_decoded"] += len(completion.token_ids)
            self.counts["requests_finished"] += 1
            completions.append(completion)
        return completions

    def stats(self) -> dict:
        running = min(self.unfinished, self.max_running)
        return dict(self.counts, running=running, waiting=self.unfinished - running)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def pinned_view(engine, max_running: int):
    """The engine `engine` (SGLangEngine, VLLMEngine) as an evaluation sees it: the same server, client and
    update records, its own request threads, its version fixed at the engine's now. Nothing pins the server
    itself: the sampler holds the next update until the evaluation is done (VersionEvaluator.hold_update),
    and every token's version, read as for any request (the server's labels; vLLM's update counts, shared
    with the engine), is checked against the fixed one. Closing the view stops its threads, not the server."""
    view = copy.copy(engine)
    view.requests = RequestPool(max_running, "eval")
    view.server = None
    return view
