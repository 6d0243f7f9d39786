"""Incremental detokenization and stop-string matching for one request.

Decoding only a short window of ids per token keeps this O(1) per step, and text that could
still become a stop string is held back until it can't.
"""


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Append a token; True when a stop string has appeared (the text is cut before it)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        if len(new) <= len(prefix) or new.endswith("\ufffd"):
            return False
        start = max(0, len(self.text) - self.holdback)
        self.text += new[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [at for at in (self.text.find(s, start) for s in self.stop) if at >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def flush(self, final: bool) -> str:
        """Text not yet emitted; while not final, keep back what may be a stop string's start."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
