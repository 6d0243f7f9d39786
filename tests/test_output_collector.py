"""A request's outputs between the engine and a reader that may lag (workers/output_collector.py):
merged per choice while unread, read as reading each output alone would have read them."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.job import Choices
from workers.output_collector import RequestOutputCollector
from workers.outputs import RequestOutput, TokenLogprobs
from workers.protocol import ParsedRequest
from workers.sampling_params import SamplingParams

ENDS = ("stop", "length", "abort", "error")


def outputs_of(choice: int, tokens: list[int], end: str, logprobs: bool) -> list[RequestOutput]:
    """A choice's outputs as the engine hands them: one per token, counts so far, then its last
    (a token of its own when it stopped or ran out, none when aborted or failed)."""
    rid, outs = f"r-{choice}", []
    for k, t in enumerate(tokens):
        lp = [TokenLogprobs(t, -t / 7, [(t + 1, -0.5)])] if logprobs else None
        last = k == len(tokens) - 1 and end in ("stop", "length")
        outs.append(RequestOutput(rid, [t], f"<{t}>", 3, k % 2, k + 1, end if last else None, logprobs=lp))
    if not outs or outs[-1].finish_reason is None:
        error = "engine_error" if end == "error" else None
        outs.append(RequestOutput(rid, [], "", 3, 1, len(tokens), end, error))
    return outs


choice_runs = st.lists(
    st.tuples(st.lists(st.integers(0, 50), max_size=6), st.sampled_from(ENDS)), min_size=1, max_size=4
)


@settings(max_examples=300, deadline=None)
@given(runs=choice_runs, logprobs=st.booleans(), script=st.lists(st.booleans(), max_size=60), data=st.data())
def test_any_reading_of_merged_outputs_reads_what_each_output_alone_says(runs, logprobs, script, data):
    """Any choices' outputs put in any interleaving, the reader reading at any moments (`script`:
    True reads once if anything is pending), then to the end: per choice, the text, token ids
    and logprobs read concatenate to the outputs' own, only the last read carries the end (its
    finish reason, error and counts), and choices are read ending in the order they ended, so
    the first failure read is the first that happened."""
    alone = {i: outputs_of(i, tokens, end, logprobs) for i, (tokens, end) in enumerate(runs)}
    order = data.draw(st.permutations([i for i, outs in alone.items() for _ in outs]))
    reads: dict[int, list[RequestOutput]] = {i: [] for i in alone}

    async def go() -> list[int]:
        collector, unread, ended = RequestOutputCollector(), set(), []
        left = {
            i: iter(outputs_of(i, tokens, end, logprobs)) for i, (tokens, end) in enumerate(runs)
        }  # the collector's

        async def read() -> None:
            i, out = await collector.get()
            assert i in unread
            unread.discard(i)
            reads[i].append(out)
            if out.finish_reason is not None:
                ended.append(i)

        for step, i in enumerate(order):
            collector.put(i, next(left[i]))
            unread.add(i)
            if step < len(script) and script[step]:
                await read()
        while unread:
            await read()
        return ended

    ended = asyncio.run(go())
    assert ended == sorted(alone, key=lambda i: len(order) - order[::-1].index(i))
    for i, outs in alone.items():
        got = reads[i]
        assert "".join(o.text for o in got) == "".join(o.text for o in outs)
        assert [t for o in got for t in o.token_ids] == [t for o in outs for t in o.token_ids]
        assert [o.finish_reason for o in got[:-1]] == [None] * (len(got) - 1)
        last, end = got[-1], outs[-1]
        assert (last.finish_reason, last.error, last.num_output, last.num_cached) == (
            end.finish_reason,
            end.error,
            end.num_output,
            end.num_cached,
        )
        entries = [e for o in got for e in o.logprobs or ()]
        assert entries == [e for o in outs for e in o.logprobs or ()]
        assert all((o.logprobs is None) == (not logprobs or not o.token_ids) for o in got)


def test_a_reader_that_lags_reads_one_output_per_choice():
    """Three choices of 100 tokens each, put before anything is read: three outputs come out,
    each holding its whole choice, where a queue held (and a stream sent) 300."""
    choices = [outputs_of(i, list(range(100)), "abort", True) for i in range(3)]
    puts = [(i, out) for step in zip(*choices) for i, out in enumerate(step)]

    async def go() -> list[tuple[int, RequestOutput]]:
        collector = RequestOutputCollector()
        for i, out in puts:
            collector.put(i, out)
        return [await collector.get() for _ in range(3)]

    got = asyncio.run(go())
    assert [i for i, _ in got] == [0, 1, 2]
    assert all(len(out.token_ids) == len(out.logprobs or ()) == 100 and out.finish_reason == "abort" for _, out in got)


def test_an_output_read_is_not_changed_by_later_ones():
    """What the reader has taken is its own: the next output of that choice waits apart."""

    async def go() -> tuple[RequestOutput, RequestOutput]:
        collector = RequestOutputCollector()
        first, second = outputs_of(0, [7, 8], "length", False)
        collector.put(0, first)
        read = (await collector.get())[1]
        collector.put(0, second)
        return read, (await collector.get())[1]

    read, later = asyncio.run(go())
    assert (read.text, read.token_ids, read.finish_reason) == ("<7>", [7], None)
    assert (later.text, later.token_ids, later.finish_reason) == ("<8>", [8], "length")


def test_a_cancelled_wait_loses_nothing():
    """The non-streamed reader cancels its wait when the client leaves or races it: an output
    put afterwards is still there for the next wait."""

    async def go() -> tuple[int, RequestOutput]:
        collector = RequestOutputCollector()
        waiting = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)
        waiting.cancel()
        collector.put(1, outputs_of(1, [5], "stop", False)[0])
        return await asyncio.wait_for(collector.get(), 5)

    i, out = asyncio.run(go())
    assert (i, out.token_ids, out.finish_reason) == (1, [5], "stop")


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    cuts=st.sets(st.integers(1, 11)),
    kind=st.sampled_from(["completion", "chat"]),
)
def test_a_choices_logprobs_read_merged_are_those_read_one_by_one(tokens, cuts, kind):
    """The `logprobs` objects built from a choice's entries read in any groups (a lagging
    reader's merges) concatenate to those built token by token: completions' text offsets
    run on from the echo whatever the grouping."""
    parsed = ParsedRequest(
        kind,
        "m",
        [1],
        SamplingParams(logprobs=1),
        True,
        False,
        False,
        {},
        echo_texts=["echo"] if kind == "completion" else None,
    )
    entries = [TokenLogprobs(t, -t / 7, [(t + 1, -0.5)]) for t in tokens]
    bounds = [0, *sorted(c for c in cuts if c < len(entries)), len(entries)]

    def read(groups: list[list[TokenLogprobs]]) -> dict[str, list]:
        state, merged = Choices(parsed, lambda t: f"<{t}>"), {}
        for group in groups:
            for key, values in (state.logprobs(0, group) or {}).items():
                merged.setdefault(key, []).extend(values)
        return merged

    assert read([entries[a:b] for a, b in zip(bounds, bounds[1:])]) == read([[e] for e in entries])
