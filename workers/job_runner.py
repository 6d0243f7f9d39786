"""A job's choices in the engine, from their handing over to the answer read from them.

Each choice is an engine request of its own whose sink routes its outputs to the job's
collector, which merges those its reader has not read yet.
A prompt's first choice goes in first; its other choices follow its first output, when its
prompt blocks are cached. The answer is read whole (`collect`) or as SSE chunks (`stream`),
under one rule: a request ends when every choice has ended, or at its first failed choice (it
fails whole), or when its reader stops (client gone, task cancelled). Ended early, its choices
still running are aborted and those not started never start: nothing runs for no one.

Every choice of a request counts once in the worker's requests_finished, by how it ended. One
never handed to the engine ends as what kept it from starting: its prompt's first choice ending
(aborted: the client left; failed), the engine refusing it (failed), or its request ending while
that first choice ran on (aborted, as that choice is then: the client left, or another prompt's
choice failed). It adds no sample to the latency and token histograms: it had no prompt, token
or latency of its own.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from workers.engine import ENGINE_ERROR, ENGINE_STOPPED, Engine, EngineStopped
from workers.job import Choices, Job
from workers.metrics import WorkerMetrics
from workers.outputs import RequestOutput, call_sinks, unstarted_failure
from workers.protocol import error_body
from workers.responses import choice, chunk, full_response
from workers.tracing import WorkerTracing
from workers.transfer_http import TransferService

FAILURES = {  # RequestOutput.error -> (HTTP status, message)
    ENGINE_ERROR: (500, "the engine failed while running this request"),
    ENGINE_STOPPED: (503, "the engine has stopped"),
}


def failure(out: RequestOutput) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body of a request the engine failed."""
    status, message = FAILURES.get(out.error or ENGINE_ERROR, FAILURES[ENGINE_ERROR])
    return status, error_body(message, "server_error", out.error)


def ended_as(first: RequestOutput | None, rid: str) -> RequestOutput:
    """The one output of a choice never started: ended as its prompt's first choice did
    (aborted, failed), or aborted (`first` None) where its request ended while that ran on."""
    if first is None:
        return RequestOutput(rid, [], "", 0, 0, 0, "abort")
    return RequestOutput(rid, [], "", 0, 0, 0, first.finish_reason, first.error)


class JobRunner:
    """Runs jobs' choices on one engine. `in_flight` counts the choices of the jobs handed to
    it, from then until each ends, started or not: a prompt's other choices wait for its first
    token, and counted only once started they escaped the worker's bound on what it holds.
    Outputs reach the sinks on the event loop the jobs are read on (`_bind`)."""

    def __init__(
        self,
        engine: Engine,
        transfer: TransferService,
        metrics: WorkerMetrics,
        tracing: WorkerTracing,
        model: str,
    ):
        self.engine = engine
        self.transfer = transfer
        self.metrics = metrics
        self.tracing = tracing
        self.model = model
        self.in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, job: Job) -> None:
        """Hand each prompt's first choice to the engine; raises EngineStopped if it refuses the
        first (it is stopping). The other choices of a prompt follow when its first one has a
        token: its prompt blocks are then cached, so they share them instead of computing the
        prompt again."""
        self._bind(asyncio.get_running_loop())
        self.in_flight += job.parsed.num_choices
        try:
            self._submit_choice(job, 0)
        except BaseException:
            self.in_flight -= job.parsed.num_choices
            raise
        for i in range(job.parsed.n, job.parsed.num_choices, job.parsed.n):
            self._submit_or_fail(job, i)

    def _submit_or_fail(self, job: Job, i: int) -> None:
        """Hand choice `i` to the engine, or fail it if the engine refuses; a prompt's first
        choice fails with the choices that would follow it: each choice needs a last output, or
        the request never ends."""
        try:
            self._submit_choice(job, i)
        except EngineStopped:
            n = job.parsed.n
            failed = range(i, i + n if i % n == 0 else i + 1)
            for k in failed:
                self._put(job, k, unstarted_failure(job.engine_key(k), [], ENGINE_STOPPED), started=False)
            self.in_flight -= len(failed)

    def _submit_choice(self, job: Job, i: int) -> None:
        """Hand choice `i` to the engine; its last output ends it in flight. A prompt's j-th
        choice samples with seed + j (vLLM's rule), so seeded choices differ."""
        p, kv = job.parsed, job.parsed.kv_transfer
        j = i % p.n
        params = p.params
        if j and params.seed is not None:
            params = replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)
        loop = asyncio.get_running_loop()
        export = self.transfer.exporter(kv["export_to"], loop, p.cache_salt, job.span) if "export_to" in kv else None
        kv_wait_s = (kv.get("wait_ms") or 0) / 1000.0  # a null wait_ms is no wait, as protocol reads it
        siblings = list(range(i + 1, i + p.n)) if j == 0 else []

        def sink(out: RequestOutput) -> None:
            self._put(job, i, out)
            if siblings:
                self._follow(job, out, siblings)
                siblings.clear()
            if out.finish_reason is not None:
                job.running.discard(i)
                self.in_flight -= 1

        self.engine.submit(
            job.engine_key(i),
            p.prompts[i // p.n],
            params,
            sink,
            kv_wait_s=kv_wait_s,
            export=export,
            cache_salt=p.cache_salt,
            trace=job.span is not None and i == 0,
        )
        job.running.add(i)

    def _put(self, job: Job, i: int, out: RequestOutput, started: bool = True) -> None:
        """Choice `i`'s output to its job, counted in the metrics as it arrives, read or not and
        before any merge: a choice aborted once no one reads its request's answer counts as
        aborted, and each engine output's tokens are timed as they came. The one output of a
        choice never handed to the engine (`started` False) counts how it ended, alone."""
        if started:
            self.metrics.observe(out, job.clocks[i])
        else:
            self.metrics.count_finished(out)
        job.outputs.put(i, out)

    def _follow(self, job: Job, first: RequestOutput, siblings: list[int]) -> None:
        """Start a prompt's other choices on its first choice's first output, unless that output
        ended the first choice (aborted, failed) or no one reads the answer any more: they would
        run to their last token for no one. Then each ends unstarted, as the first did, or
        aborted where the first runs on (`_abort` aborts it): counted once either way, where a
        client leaving once counted none of them and a failure each."""
        ended = first.finish_reason in ("abort", "error")
        if ended or job.cancelled:
            for s in siblings:
                self._put(job, s, ended_as(first if ended else None, job.engine_key(s)), started=False)
            self.in_flight -= len(siblings)
            return
        for s in siblings:
            self._submit_or_fail(job, s)

    def _abort(self, job: Job) -> None:
        """No one reads the answer any more (or it has failed): abort its choices running, and
        keep those not started from starting (`_follow`)."""
        job.cancelled = True
        for i in job.running:
            self.engine.abort(job.engine_key(i))

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have the engine post each step's outputs to this loop, where the sinks (collector puts)
        must run. Done on first use, not at startup: an app mounted elsewhere or served
        without lifespan events never runs the startup hook."""
        if self._loop is not loop:
            self._loop = loop

            def deliver(batch: list[tuple[Callable, RequestOutput]]) -> None:
                loop.call_soon_threadsafe(call_sinks, batch)

            self.engine.deliver = deliver

    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    async def collect(self, job: Job, gone: Awaitable[None]) -> tuple[int, dict]:
        """The whole answer (HTTP status, body) once every choice has ended, or the error of the
        first that failed; a 499 if `gone` (the client went away) completes first."""
        p = job.parsed
        state = Choices(p, self._decode_token)
        texts = {i: [state.echo(i)] for i in range(p.num_choices)}
        ids: dict[int, list[int]] = {i: [] for i in range(p.num_choices)}
        entries: dict[int, list] = {i: [] for i in range(p.num_choices)}
        disconnect = asyncio.ensure_future(gone)
        try:
            while not state.ended:
                get = asyncio.ensure_future(job.outputs.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return 499, error_body("client disconnected", "invalid_request_error", "client_closed")
                i, out = get.result()
                self._take(job, state, i, out)
                texts[i].append(out.text)
                ids[i].extend(out.token_ids)
                entries[i].extend(out.logprobs or ())
        finally:
            disconnect.cancel()
            self._close(job, state)
        if state.failure is not None:
            return failure(state.failure)
        choices = [
            choice(
                p.kind,
                i,
                "".join(texts[i]),
                state.last[i].finish_reason,
                state.logprobs(i, entries[i]),
                ids[i] if p.return_token_ids else None,
            )
            for i in range(p.num_choices)
        ]
        return 200, full_response(p.kind, job.shown, self.model, choices, state.usage())

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        """SSE chunks as the engine produces them, each naming its choice; a client reading
        slower than that gets one chunk per choice for all it produced meanwhile (the collector
        merges them). A request that fails ends with an OpenAI error event, then [DONE]."""
        p, rid = job.parsed, job.shown
        state = Choices(p, self._decode_token)
        try:
            if p.kind == "chat":
                for i in range(p.num_choices):
                    yield sse(chunk(p.kind, rid, self.model, "", None, first=True, index=i))
            while not state.ended:
                i, out = await job.outputs.get()
                text = out.text if i in state.last else state.echo(i) + out.text
                self._take(job, state, i, out)
                if out.error is not None:
                    yield sse(failure(out)[1])
                elif text or out.finish_reason or p.return_token_ids or out.logprobs:
                    yield sse(
                        chunk(
                            p.kind,
                            rid,
                            self.model,
                            text,
                            out.finish_reason,
                            index=i,
                            token_ids=out.token_ids if p.return_token_ids else None,
                            logprobs=state.logprobs(i, out.logprobs),
                        )
                    )
            if p.include_usage and state.failure is None:
                body = chunk(p.kind, rid, self.model, "", None)
                body["choices"] = []
                body["usage"] = state.usage()
                yield sse(body)
            yield b"data: [DONE]\n\n"
        finally:
            self._close(job, state)

    def _take(self, job: Job, state: Choices, i: int, out: RequestOutput) -> None:
        """Read choice `i`'s output into `state`. A request fails whole: its first failed choice
        aborts the others at once, for both answers alike. The span traces choice 0: it ends
        with choice 0's last output, or with the failure if that comes first."""
        traced = state.has_ended(0)
        state.add(i, out)
        if out.finish_reason is not None and (i == 0 or out.error is not None) and not traced:
            self.tracing.finish(job.span, out)
        if state.failure is out:
            self._abort(job)

    def _close(self, job: Job, state: Choices) -> None:
        """Reading stopped before the request ended (the client left, the task was cancelled):
        abort its choices still running, keep those not started from starting, and end its span
        with a 499 unless choice 0 has ended it."""
        if state.ended:
            return
        self._abort(job)
        if not state.has_ended(0):
            self.tracing.end(job.span, 499)


def sse(obj: dict) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
