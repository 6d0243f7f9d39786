"""What a worker's GET /state carries: its load as of its last step. One type for the engine
and the fleet simulator that produce it and the gateway (and the simulator's router) that
reads it; the JSON is its fields, flat.

A body comes from another process of the fleet, which the gateway does not trust to be well
formed: `WorkerState.from_json` checks every field the gateway reads against its type (the
dataclass fields' annotations, the server's own fields' in `SERVER_FIELDS`), so a bad body is
one ValueError where it arrives, not a TypeError in whatever reads the field later."""

from dataclasses import MISSING, asdict, dataclass, fields
from types import NoneType
from typing import Any, NamedTuple, get_args, get_origin

from workers.generation_defaults import GenerationDefaults
from workers.kv.cost_model import CostModel
from workers.kv.events import shown


@dataclass(frozen=True)
class WorkerState:
    """`step_*` are the means over the last steps of their time and work (`CostModel.step_ms`
    terms), `decode_step_*` the same over the decode-only ones (`workers/step_stats.py`)."""

    worker_id: str
    role: str = "mixed"
    model: str | None = None
    block_size: int = 16
    total_blocks: int = 0
    free_blocks: int = 0
    shared_blocks: int = 0  # blocks in use by two or more requests (a prefix they share)
    host_blocks: int = 0  # the host tier's size (0: none)
    host_free_blocks: int = 0
    disk_blocks: int = 0  # the disk tier's size (0: none)
    disk_free_blocks: int = 0
    host_gbps: float | None = None  # its host -> device copy rate (--host-kv-gbps); None: not published
    disk_gbps: float | None = None  # its file -> device read rate (--disk-kv-gbps)
    load_every_hit: bool = False  # it copies back every slow-tier hit (--kv-load-every-hit)
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens not computed yet (a waiting hit counts its miss)
    kv_tokens: int = 0  # tokens whose K/V the running requests hold
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    step_ms: float | None = None
    step_prefill_tokens: float = 0.0
    step_prefill_ctx_products: float = 0.0
    step_decode_seqs: float = 0.0
    step_decode_kv_tokens: float = 0.0
    decode_step_ms: float | None = None
    decode_step_seqs: float = 0.0
    decode_step_kv_tokens: float = 0.0
    cost_model: dict | None = None  # the worker's own profile (sim executor), if it has one
    kv_bytes_per_token: int = 0
    kv_seq: int = 0  # its last KV event
    preemptions: int = 0
    pending_kv: int = 0  # P/D decode requests waiting for their blocks
    engine_calls_s: float = 0.0
    max_model_len: int | None = None
    export_batch_blocks: int = 0  # P/D: blocks per export batch mid-prefill (0: one transfer after it)
    generation_defaults: dict | None = None  # the model's sampling defaults (GenerationDefaults' JSON)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict, checked: dict | None = None) -> "WorkerState":
        """The known fields of a /state body (an older worker may lack newer ones: their
        defaults stand). Raises ValueError naming the first field, its own or one its server
        adds (`SERVER_FIELDS`), that breaks its `Rule`: the body is another process's, and a
        field read later as its type must be that type. `checked`: a body accepted before, whose
        values `d` holds as the very objects (a KV-event line's state is the stream's last one
        with what changed merged in) are not checked again: a state rides on every line, and
        its cost model's 64 coefficients were most of a line's CPU."""
        if not isinstance(d, dict):
            raise ValueError(f"a worker state is a JSON object, not {type(d).__name__}")
        fresh = d if checked is None else {k: v for k, v in d.items() if v is not checked.get(k, _ABSENT)}
        check(fresh, _RULES, "state")
        if not d.get("worker_id"):
            raise ValueError("state.worker_id must be a non-empty string")
        if d.get("block_size", 1) < 1:
            raise ValueError("state.block_size must be at least 1")  # prompts are cut by it
        for name, nested in _NESTED.items():
            if fresh.get(name) is not None:
                check(fresh[name], nested, f"state.{name}")
        if fresh.get("generation_defaults") is not None:
            GenerationDefaults.from_json(fresh["generation_defaults"])  # raises ValueError naming the field
        state = object.__new__(WorkerState)
        object.__setattr__(state, "__dict__", _DEFAULTS | {name: d[name] for name in _FIELDS & d.keys()})
        return state


_ABSENT = object()  # no value: unlike any a body holds
_MAX = 1 << 63  # past it a number is no count, size or time (and may not convert to a float)


class Rule(NamedTuple):
    """What a JSON value may be: one of `types`; a number also finite and in [`low`, 2**63),
    so a count, size or time never turns into inf, NaN or an overflow downstream; a list's
    items each by `items`."""

    types: frozenset[type]
    low: float = 0.0
    items: "Rule | None" = None

    def __str__(self) -> str:
        names = " or ".join(sorted("null" if t is NoneType else t.__name__ for t in self.types))
        numbers = f", finite, at least {self.low:g}" if int in self.types or float in self.types else ""
        return names + numbers + (f" of {self.items}" if self.items else "")


def rule(annotation: object, low: float = 0.0) -> Rule:
    """The rule for a field annotated `annotation`: its types (a float also takes a JSON int; a
    `tuple[float, ...]` is a list of floats), numbers at least `low`."""
    if get_origin(annotation) is tuple:
        return Rule(frozenset({list, tuple}), low, rule(get_args(annotation)[0], low))
    types = set(get_args(annotation) or (annotation,))
    if float in types:
        types.add(int)
    return Rule(frozenset(types), low)


def rules(annotations: dict[str, object], low: float = 0.0) -> dict[str, Rule]:
    return {name: rule(a, low) for name, a in annotations.items()}


def fits(v: Any, r: Rule) -> bool:
    """Whether JSON value `v` keeps rule `r`. Its type exactly: a bool is no int here, nor an
    int a bool."""
    t = type(v)
    if t not in r.types:
        return False
    if t is int or t is float:
        return r.low <= v < _MAX
    return r.items is None or all(fits(x, r.items) for x in v)


def check(d: dict, by_name: dict[str, Rule], what: str) -> None:
    """Raise ValueError naming the first field of `d` that breaks its rule in `by_name`; fields
    it does not know pass (a newer peer's). One pass over the body, `fits` inlined but for
    lists: it runs per state, and a state rides on every KV-event line."""
    for name, v in d.items():
        r = by_name.get(name)
        if r is None:
            continue
        types, low, items = r
        t = type(v)
        if t not in types or ((t is int or t is float) and not low <= v < _MAX) or (items and not fits(v, r)):
            raise ValueError(f"{what}.{name} must be {r}, not {shown(v)}")


_FIELDS = frozenset(f.name for f in fields(WorkerState))  # `fields` builds its tuple anew each call
# Built past `__init__` from these, as `gateway.worker_view.with_fields` copies a view: its 36
# frozen `__setattr__`s were half of a state's parse, which runs per KV-event line.
_DEFAULTS = {f.name: f.default for f in fields(WorkerState) if f.default is not MISSING}
# What a worker's server adds to its engine's state in a /state body (workers/control_routes.py).
SERVER_FIELDS: dict[str, object] = {
    "engine_alive": bool,
    "draining": bool,
    "engine_stall_s": float | None,
    "kv_transfer": dict | None,
}
TRANSFER_FIELDS: dict[str, object] = {"transport": str, "gbps": float | None, "backlog_bytes": int | None}
_RULES = rules({f.name: f.type for f in fields(WorkerState)} | SERVER_FIELDS)
# The objects within a body, by field: a profile's coefficients are fitted (finite, any sign).
_NESTED = {
    "cost_model": rules({f.name: f.type for f in fields(CostModel)}, low=-_MAX),
    "kv_transfer": rules(TRANSFER_FIELDS),
}
