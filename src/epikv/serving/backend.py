"""The one interface between `epikv serve`'s HTTP layer (serving/app.py) and an engine.

The app parses requests, applies sampling parameters, stop strings, the reasoning parser, metrics, back-pressure,
timeouts and the drain on shutdown; an engine only runs token ids. An engine is any object with the methods of
`Backend` below; `TransformersBackend` is transformers' continuous batching with epikv's eviction
(`start_manager`). A second engine (llama.cpp) implements the same methods and is served by the same app.

Every request is run streaming inside the engine (one output per new token), whatever the client asked for, so the
app sees each token's arrival (time to first token, inter-token latency, which requests still wait for their first
token) the same way for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import Sampling


@dataclass
class Output:
    """What an engine reports for a request: every token generated so far, whether it ended, or why it failed."""

    request_id: str
    tokens: list[int]
    finished: bool
    error: str | None = None


class Backend:
    """What the app needs from an engine (the methods to implement; none is optional).

    sampling_fields: which of temperature, top_p, top_k, min_p, seed the engine honours (others are refused by the
    app with a 400). per_request_eos: whether `submit(ignore_eos=True)` is possible."""

    sampling_fields: frozenset = frozenset()
    per_request_eos: bool = False
    capacity_flags: str = "its capacity"  # the options that size the cache, named in over-limit refusals

    def submit(self, rid: str, input_ids: list[int], max_tokens: int, *, sampling: Sampling | None, seed: int,
               ignore_eos: bool) -> None:
        """Queue a request (streamed: one Output per new token). sampling None: greedy. Raises RuntimeError when
        the engine does not take it."""
        raise NotImplementedError

    def next_output(self, timeout: float) -> Output | None:
        """The next output of any request, or None after `timeout` seconds (called from one router thread)."""
        raise NotImplementedError

    def cancel(self, rid: str, completed: bool = False) -> None:
        """Stop a request early (the client left, a timeout; completed=True: a stop string ended its answer); its
        pages return to the pool."""
        raise NotImplementedError

    def release(self, rid: str) -> None:
        """The request is over for the app (finished, failed or cancelled): forget what was kept for it."""
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def prompt_refusal(self, n_prompt: int) -> str | None:
        """Why a prompt of n_prompt tokens can never be served (a 400, one line), or None."""
        raise NotImplementedError

    def stats(self) -> dict:
        """The engine's counters, as /stats shows them."""
        raise NotImplementedError

    def gauges(self) -> dict:
        """Numbers for /metrics, read now: pages_in_use and pages_free (a paged cache) or cells_in_use and
        cells_free (a cache of single cells), and the running totals evictions, evicted_tokens, preemptions."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class TransformersBackend(Backend):
    """transformers' ContinuousBatchingManager started by `epikv.serving.start_manager` (eviction inside)."""

    sampling_fields = frozenset({"temperature", "top_p", "top_k", "min_p", "seed"})
    capacity_flags = "--num-blocks x --page"

    def __init__(self, manager) -> None:
        import inspect

        from .scheduler import prompt_refusal, serving_stats

        self.manager = manager
        self.rt = manager._epikv_runtime
        self._stats, self._refusal = serving_stats, prompt_refusal
        # per-request EOS (what ignore_eos needs) is an add_request argument only in some transformers versions
        self.per_request_eos = "eos_token_id" in inspect.signature(manager.add_request).parameters

    def submit(self, rid, input_ids, max_tokens, *, sampling, seed, ignore_eos) -> None:
        if sampling is not None and sampling.temperature > 0:
            from .sampling import RequestSampler

            self.rt.samplers[rid] = RequestSampler(sampling, seed, input_ids, max_tokens, self.rt.device)
        kw = {"eos_token_id": -1} if ignore_eos else {}
        try:
            got = self.manager.add_request(list(input_ids), request_id=rid, max_new_tokens=max_tokens,
                                           streaming=True, **kw)
        except Exception as e:  # e.g. the input queue stayed full
            self.release(rid)
            raise RuntimeError(f"the engine did not take the request: {type(e).__name__}: {e}") from None
        if got is None:  # the manager is stopping and dropped it
            self.release(rid)
            raise RuntimeError("the server is shutting down")

    def next_output(self, timeout: float) -> Output | None:
        out = self.manager.get_result(timeout=timeout)
        if out is None:
            return None
        err = getattr(out, "error", None)
        return Output(out.request_id, list(out.generated_tokens), bool(out.is_finished()),
                      None if err is None else str(err))

    def cancel(self, rid: str, completed: bool = False) -> None:
        self.manager.cancel_request(rid)

    def release(self, rid: str) -> None:
        self.rt.samplers.pop(rid, None)

    def healthy(self) -> bool:
        return bool(self.manager.is_running())

    def prompt_refusal(self, n_prompt: int) -> str | None:
        return self._refusal(self.manager, n_prompt)

    def stats(self) -> dict:
        return self._stats(self.manager)

    def gauges(self) -> dict:
        rt = self.rt
        st = rt.stats
        return {"pages_in_use": rt.pages_in_use(), "pages_free": rt.lay.free_count() if rt.lay is not None else 0,
                "evictions": st["evictions"], "evicted_tokens": st["evicted_tokens"] + sum(
                    t.evicted for t in list(rt.tracks.values())),
                "preemptions": st["offloads"] + st["soft_resets"]}

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=10)
