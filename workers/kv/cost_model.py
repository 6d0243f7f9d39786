"""The step-time cost model: the `sim` executor sleeps by it and policies predict TTFT/TPOT by it.

It lives in `workers/kv` (the pure, torch-free contract package) so the worker that simulates
time and the gateway that predicts time use one formula. `kvgate calibrate` fits its
coefficients to a real worker and writes them as JSON (a "profile").
"""

import json
from dataclasses import asdict, astuple, dataclass


@dataclass(frozen=True)
class StepWork:
    """The work of one step in the cost model's terms (fields in `CostModel.step_ms`'s order).
    Fractional when it is a mean over steps, as /state reports it."""

    prefill_tokens: float = 0
    prefill_ctx_products: float = 0.0  # sum over prefill chunks of tokens x (start + tokens / 2)
    decode_seqs: float = 0
    decode_kv_tokens: float = 0  # KV tokens the decodes read, their own included

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "StepWork":
        return StepWork(**{k: d.get(k, 0) for k in StepWork.__dataclass_fields__})


@dataclass(frozen=True)
class CostModel:
    """Milliseconds one engine step takes, as a linear model of its work.

    step = base + prefill_token * P + prefill_attn * sum(P_i * ctx_i) / 1000
                + decode_seq * D + decode_kv_token * (KV tokens read by the D decodes)
                + mixed (when the step both prefills and decodes)

    `mixed` is what running decodes beside a prefill adds beyond their rows: the decode
    attention path, which a prefill-only step does not run. `decode_batch_ms`, when measured,
    replaces `base + decode_seq * D` in a step that only decodes, for D = 1, 2, ... up to its
    length (beyond it the last entry grows by `decode_batch_slope` per sequence): small batches
    are not linear in D (on a CPU a decode of 3 costs more than one of 4, as matmul kernels
    change with the row count). Closed-form predictions use the linear terms alone.
    """

    base_ms: float = 4.0
    prefill_token_ms: float = 0.08
    prefill_attn_ms: float = 0.002
    decode_seq_ms: float = 0.25
    decode_kv_token_ms: float = 0.00005
    mixed_ms: float = 0.0
    decode_batch_ms: tuple[float, ...] = ()
    decode_batch_slope_ms: float = 0.0

    def step_ms(
        self,
        prefill_tokens: float = 0,
        prefill_ctx_products: float = 0.0,
        decode_seqs: float = 0,
        decode_kv_tokens: float = 0,
    ) -> float:
        """One step's time. Arguments may be means over steps (fractional), as /state gives them."""
        if prefill_tokens == 0:
            if decode_seqs == 0:
                return 0.0
            if self.decode_batch_ms:
                return self._decode_table_ms(decode_seqs) + self.decode_kv_token_ms * decode_kv_tokens
        return (
            self.base_ms
            + self.prefill_token_ms * prefill_tokens
            + self.prefill_attn_ms * prefill_ctx_products / 1000.0
            + self.decode_seq_ms * decode_seqs
            + self.decode_kv_token_ms * decode_kv_tokens
            + (self.mixed_ms if prefill_tokens and decode_seqs else 0.0)
        )

    def work_ms(self, work: StepWork) -> float:
        return self.step_ms(*astuple(work))

    def _decode_table_ms(self, seqs: float) -> float:
        """A decode-only step of `seqs` sequences from the measured table: linear between its
        batch sizes (a mean batch is fractional), its slope past its end."""
        table, n = self.decode_batch_ms, len(self.decode_batch_ms)
        if seqs >= n:
            return table[-1] + self.decode_batch_slope_ms * (seqs - n)
        lo = max(1, int(seqs))
        return table[lo - 1] + (seqs - lo) * (table[lo] - table[lo - 1])

    def prefill_ms(self, uncached_tokens: int, cached_tokens: int = 0, chunk: int = 0) -> float:
        """Time to prefill `uncached_tokens` after `cached_tokens`, in steps of at most `chunk`."""
        if uncached_tokens <= 0:
            return 0.0
        chunk = chunk or uncached_tokens
        total, done = 0.0, cached_tokens
        left = uncached_tokens
        while left > 0:
            n = min(chunk, left)
            total += self.step_ms(prefill_tokens=n, prefill_ctx_products=n * (done + n / 2))
            done += n
            left -= n
        return total

    def decode_ms(self, batch: int, kv_tokens: int) -> float:
        """One decode step of `batch` sequences reading `kv_tokens` tokens of KV in total."""
        return self.step_ms(decode_seqs=batch, decode_kv_tokens=kv_tokens)

    def scaled(self, factor: float, decode_factor: float | None = None) -> "CostModel":
        """Every step `factor` times as long: the same hardware uniformly slowed down (or sped
        up), e.g. by other jobs taking turns on its cores. With `decode_factor`, what decoding
        rows cost (the decode table, and per sequence and KV token) scales by it instead, and
        the rest (base, prefill, mixed) by `factor`: prefill and decode slow down unequally
        when what limits them differs (compute against memory bandwidth)."""
        d = factor if decode_factor is None else decode_factor
        decode = {"decode_seq_ms", "decode_kv_token_ms", "decode_batch_slope_ms"}
        times = {k: v * (d if k in decode else factor) for k, v in asdict(self).items() if k != "decode_batch_ms"}
        return CostModel(**times, decode_batch_ms=tuple(x * d for x in self.decode_batch_ms))

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "CostModel":
        fields = {k: float(v) for k, v in d.items() if k in CostModel.__dataclass_fields__ and k != "decode_batch_ms"}
        return CostModel(**fields, decode_batch_ms=tuple(float(x) for x in d.get("decode_batch_ms") or ()))

    @staticmethod
    def load(path: str) -> "CostModel":
        with open(path) as f:
            return CostModel.from_json(json.load(f))
