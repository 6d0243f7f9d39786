"""Prompt -> token ids -> block hashes at the gateway, exactly as the workers do it.

The gateway runs the workers' own `parse_request` with the model's own tokenizer (and chat
template) and the shared `workers.kv.hashing` chain, so its hashes name the very blocks the
workers cache. A prompt's text is tokenized once per distinct prefix (`workers.prefix_tokens`),
and ASCII text word by word from cached ids (`workers.word_tokens`). What is left to tokenize
past the cached prefixes decides where: up to `INLINE_CHARS` on the event loop, where a thread
hop would cost more than the work (~1 ms of CPU a request on 2k-token prompts that share a
prefix); more in a thread, so a long new prompt never stalls the loop, and so does a body past
`INLINE_MAX_BYTES` (its hashing alone would).
"""

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.passthrough import parse_whole
from workers.generation_defaults import NEUTRAL, GenerationDefaults
from workers.given_ids import fingerprint
from workers.prefix_tokens import Budgeted, OverBudget, PrefixTokenizer
from workers.kv.hashing import block_hashes, salted_seed, seed_hash
from workers.model_store import load_tokenizer, served_name
from workers.prompt_length import token_chars
from workers.protocol import ParsedRequest, parse_request

log = logging.getLogger("kvgate.gateway")

INLINE_CHARS = 4096  # ~600 tokens of new text: ~1 ms to tokenize, less than a thread hop costs
# A body past this goes to a thread however much of it is cached: its blocks are hashed and
# its cached ids gathered on the way (~2 us a block), ~2 ms at this size.
INLINE_MAX_BYTES = 64 * 1024


@dataclass
class Prepared:
    """A parsed request and its first prompt's block hashes (a request may hold several prompts
    and ask for several completions of each; it is routed by its first)."""

    parsed: ParsedRequest
    hashes: list[int]

    @property
    def num_tokens(self) -> int:
        """Prompt tokens over all its prompts."""
        return self.parsed.prompt_tokens

    @property
    def max_tokens(self) -> int:
        """Output tokens the request may generate, over all its completions (what the policies
        predict by)."""
        return self.parsed.params.max_tokens * self.parsed.num_choices

    @property
    def asked_tokens(self) -> int:
        """Output tokens the request asks for, over all its completions: its charge, as asked,
        not cut to the context this gateway parsed it by (a worker of the model may have a
        larger one, and generate them)."""
        return self.parsed.asked_tokens * self.parsed.num_choices


class ModelTokenizer:
    """One served model's tokenizer and block-hash seed."""

    def __init__(self, name: str, tokenizer, block_size: int):
        self.name = name
        self.tokenizer = PrefixTokenizer(tokenizer)
        self.inline = Budgeted(self.tokenizer)  # used on the event loop only
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust side
        self.fingerprint = fingerprint(tokenizer)  # a worker with the same takes the gateway's ids
        on = {True: "on", False: "off"}
        log.info(
            "model %r: prompt prefix token cache %s, word token cache %s",
            name,
            on[self.tokenizer.enabled],
            on[self.tokenizer.words is not None],
        )
        self.block_size = block_size
        self.seed = seed_hash(name, block_size)
        for checked in (self.tokenizer, self.inline):  # the prompt-length bound's vocabulary scan, at load
            token_chars(checked)

    def count(self, texts: list[str]) -> int:
        """Tokens of `texts` as `encode` counts them (special tokens included), in one batched
        call of a fast tokenizer (its Rust side, which releases the GIL): not one call a text,
        which for an embeddings request's 2048 inputs held the GIL for tens of ms."""
        if self.backend is None:
            return sum(len(self.tokenizer.encode(t)) for t in texts)
        return sum(len(e.ids) for e in self.backend.encode_batch(texts, add_special_tokens=True))

    def prepare(
        self,
        body: object,
        kind: str,
        max_model_len: int,
        whole: bool = False,
        budget: int | None = None,
        defaults: GenerationDefaults = NEUTRAL,
    ) -> Prepared:
        """Validate and tokenize like the worker, then hash the full blocks (raises InvalidRequest).
        `whole`: the request goes unchanged to vLLM workers, which take more (gateway/passthrough.py).
        `budget`: OverBudget past that many characters to tokenize beyond cached prefixes (on
        the event loop only). `defaults`: the kvgate workers' sampling defaults for the model."""
        tokenizer: PrefixTokenizer | Budgeted = self.tokenizer
        if budget is not None:
            self.inline.left, tokenizer = budget, self.inline
        if whole:
            parsed = parse_whole(body, kind, tokenizer, max_model_len)
        else:
            parsed = parse_request(body, kind, tokenizer, max_model_len, defaults=defaults)
        seed = salted_seed(self.seed, parsed.cache_salt)
        return Prepared(parsed, block_hashes(parsed.prompt_ids, self.block_size, seed))


class Tokenizers:
    """Tokenizers by served model name: `--model` ones up front, fleet aliases on first use.

    A model whose tokenizer cannot be loaded here (say a path that exists only on the workers)
    maps to None: its requests are routed cache-blind and validated by the worker.
    """

    def __init__(self, block_size: int, models: Sequence[str] = ()):
        self.block_size = block_size
        self.sources = {served_name(m): m for m in models}
        self._loading: dict[str, asyncio.Future] = {}

    async def get(self, name: str) -> ModelTokenizer | None:
        fut = self._loading.get(name)
        if fut is None:
            fut = self._loading[name] = asyncio.ensure_future(asyncio.to_thread(self._load, name))
        return await asyncio.shield(fut)

    def _load(self, name: str) -> ModelTokenizer | None:
        source = self.sources.get(name, name)
        try:
            return ModelTokenizer(name, load_tokenizer(source), self.block_size)
        except (OSError, ValueError) as e:
            log.warning("no tokenizer for model %r (%s): routing it cache-blind", name, e)
            return None

    async def prepare(
        self,
        tok: ModelTokenizer,
        body: dict,
        kind: str,
        size: int,
        max_model_len: int,
        whole: bool = False,
        defaults: GenerationDefaults = NEUTRAL,
    ) -> Prepared:
        """`tok.prepare` here when the body (of `size` bytes) is short, or not too long and what
        it leaves to tokenize past cached prefixes is short; else in a thread (from the start:
        the parse is pure)."""
        if size <= INLINE_MAX_BYTES:
            try:
                budget = None if size <= INLINE_CHARS else INLINE_CHARS
                return tok.prepare(body, kind, max_model_len, whole, budget, defaults)
            except OverBudget:
                pass
        return await asyncio.to_thread(tok.prepare, body, kind, max_model_len, whole, None, defaults)
