"""The requests-only calibration (servers without a step log, like vLLM) recovers a known cost model."""

import pytest

from bench.calibrate_requests import fit
from workers.kv.cost_model import CostModel

TRUE = CostModel(
    base_ms=6.0, prefill_token_ms=0.09, prefill_attn_ms=0.003, decode_seq_ms=0.4, decode_kv_token_ms=0.0002
)
OVERHEAD_MS = 12.0


def samples() -> list[dict]:
    """What the probes would measure on a server that runs exactly TRUE, plus a fixed overhead."""
    out = []
    for ctx in (64, 512):
        for b in (1, 2, 3, 4, 6, 8):
            kv = b * (ctx + 16 + 12)
            gap = TRUE.decode_ms(b, kv)
            out.append({"kind": "decode", "key": ("decode", b, ctx), "batch": b, "kv": kv, "gap_ms": gap, "ms": gap})
    for n in (16, 64, 128, 256, 512, 1024):
        ttft = OVERHEAD_MS + TRUE.step_ms(n, n * n / 2)
        out.append(
            {"kind": "prefill", "key": ("prefill", n), "tokens": n, "ctx": n * n / 2, "ttft_ms": ttft, "ms": ttft}
        )
    return out


def test_fit_recovers_the_cost_model_and_the_request_overhead():
    got = fit(samples())
    for k in ("base_ms", "prefill_token_ms", "prefill_attn_ms", "decode_seq_ms", "decode_kv_token_ms"):
        assert got[k] == pytest.approx(getattr(TRUE, k), rel=0.02, abs=1e-6), k
    assert got["request_overhead_ms"] == pytest.approx(OVERHEAD_MS, rel=0.02)
    assert got["fit_rel_rmse"] < 0.01
    model = CostModel.from_json(got)
    assert model.decode_ms(3, 300) == pytest.approx(TRUE.decode_ms(3, 300), rel=0.02)
