"""A request's choices as the worker reads their outputs (workers/job.py)."""

from workers.job import Choices
from workers.protocol import MAX_CHOICES, MAX_N, ParsedRequest
from workers.sampling_params import SamplingParams


class Output:
    """A choice's output that counts how often its end is looked at."""

    looks = 0

    def __init__(self, finish_reason: str | None):
        self._finish_reason = finish_reason
        self.error = None

    @property
    def finish_reason(self) -> str | None:
        Output.looks += 1
        return self._finish_reason


def test_reading_an_output_costs_the_same_whatever_the_number_of_choices():
    """The most choices a request may ask for (MAX_CHOICES), two outputs each, read as the
    server reads them (whether the request has ended is asked after every output): a few looks
    per output. Each output once looked at every choice's last one, so such a request cost the
    event loop O(choices) per token, a million looks here."""
    prompts = [[1]] * (MAX_CHOICES // MAX_N)
    parsed = ParsedRequest("completion", "m", [1], SamplingParams(), False, False, False, {}, prompts=prompts, n=MAX_N)
    state = Choices(parsed, str)
    outputs = [(i, Output(reason)) for reason in (None, "length") for i in range(MAX_CHOICES)]
    for i, out in outputs:
        assert not state.ended
        state.add(i, out)
    assert state.ended and state.done
    assert Output.looks <= 4 * len(outputs)
