"""An engine's KV events re-hashed into kvgate's own block chain, with reference counts.

Events carry the token ids of every stored block, so the gateway derives each block's kvgate
hash itself (`workers.kv.hashing`) and keeps one hash function for the whole fleet whatever
the engine and its hash seed. An engine block of B tokens becomes B / b kvgate blocks of the
gateway's size b (B must be a multiple of b). A block's chain continues from its parent's last
kvgate hash, so a block whose parent the translator never saw cannot be placed and is left
out, as are blocks whose engine hash covers more than tokens and a cache salt (LoRA adapters,
multimodal inputs, prompt embeddings, non-full-attention groups): no kvgate hash names them.

The same engine block may be stored more than once (two physical copies of one prefix), so
engine blocks are counted per tier; a kvgate hash is resident in a tier while any engine block
there yields it. `apply` returns only the transitions: hashes that became resident in a tier or
stopped being so. Tiers are events' `medium` (vllm_events.MEDIA: vLLM's offloading connector
stores a device block's copy in CPU memory as medium CPU, our `host`); a block's chain is the
same in every tier, so a child stored in one tier continues its parent seen in any. A placeholder
without token ids (vLLM offloads a block it has no metadata for) has no kvgate hash and is left
out, as are blocks of a medium kvgate has no tier for.

An engine hash names one content in every tier: should a copy come with other token ids (a
publisher contradicting itself), the content first seen stands while any copy is held, so each
removal releases exactly the kvgate hashes its store held.
"""

from dataclasses import dataclass, field

from gateway.vllm_events import Cleared, EngineHash, Event, Removed, Stored
from workers.kv.events import CLEARED, DEVICE, MEDIA, REMOVED, STORED
from workers.kv.hashing import block_hashes, salted_seed, seed_hash


@dataclass(frozen=True)
class Change:
    """A change to the residency of kvgate hashes (kind: stored, removed or cleared)."""

    kind: str
    hashes: tuple[int, ...] = ()
    medium: str = DEVICE


MAX_REASONS = 64  # distinct skip reasons kept by name
MAX_REASON_LEN = 120  # and each cut to this many characters


@dataclass
class TranslateStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    skipped_blocks: int = 0
    orphan_blocks: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


class Translator:
    def __init__(self, model: str, block_size: int, stats: TranslateStats | None = None):
        self.model = model
        self.block_size = block_size
        self.seed = seed_hash(model, block_size)
        self.stats = stats or TranslateStats()
        self.reset()

    def reset(self) -> None:
        """Forget everything: the engine's cache is unknown from here on."""
        self._ours: dict[tuple[int, EngineHash], tuple[int, ...]] = {}  # (group, engine hash) -> ours
        self._refs: dict[tuple[str, int, EngineHash], int] = {}  # (medium, group, engine hash) -> copies
        self._count: dict[tuple[str, int], int] = {}  # (medium, kvgate hash) -> engine blocks yielding it

    @property
    def resident(self) -> set[int]:
        """Every kvgate hash resident on the device now."""
        return self.tier(DEVICE)

    def tier(self, medium: str) -> set[int]:
        """Every kvgate hash resident in tier `medium` now."""
        return {h for m, h in self._count if m == medium}

    def tiers(self) -> dict[str, list[int]]:
        """The tiers below the device, by medium (a snapshot's `tiers`)."""
        return {m: sorted(self.tier(m)) for m in MEDIA if m != DEVICE and self.tier(m)}

    def apply(self, events: tuple[Event, ...] | list[Event]) -> list[Change]:
        out: list[Change] = []
        for ev in events:
            if isinstance(ev, Stored):
                added = self._stored(ev)
                if added:
                    out.append(Change(STORED, tuple(added), ev.medium))
            elif isinstance(ev, Removed):
                gone = self._removed(ev)
                if gone:
                    out.append(Change(REMOVED, tuple(gone), ev.medium))
            elif isinstance(ev, Cleared):
                self.reset()
                out.append(Change(CLEARED))
        return out

    def _skip(self, ev: Stored) -> str | None:
        """Why `ev`'s blocks have no kvgate hash, or None."""
        if ev.medium not in MEDIA:
            return f"medium {ev.medium[:40]}"
        if not ev.token_ids:
            return "no token ids"
        if ev.lora:
            return "lora"
        if not ev.full_attention:
            return "not full attention"
        if ev.unknown:
            return "unknown fields " + ",".join(ev.unknown)
        if ev.block_size % self.block_size:
            return f"engine block size {ev.block_size} is not a multiple of {self.block_size}"
        for i, keys in enumerate(ev.extra):
            if keys is not None and not (i == 0 and ev.parent is None and len(keys) == 1 and isinstance(keys[0], str)):
                return "extra hash keys (multimodal, prompt embeddings)"
        return None

    def _stored(self, ev: Stored) -> list[int]:
        why = self._skip(ev)
        if why is not None:
            return self._skipped(why, len(ev.hashes))
        if ev.parent is None:
            salt = ev.extra[0][0] if ev.extra and ev.extra[0] else ev.salt
            prev = salted_seed(self.seed, salt)
        else:
            parent = self._ours.get((ev.group, ev.parent))
            if parent is None:
                self.stats.orphan_blocks += len(ev.hashes)
                return self._skipped("parent not seen", len(ev.hashes))
            prev = parent[-1]
        ours = block_hashes(list(ev.token_ids), self.block_size, self.seed, parent=prev)
        per = ev.block_size // self.block_size
        added: list[int] = []
        for i, h in enumerate(ev.hashes):
            key = (ev.medium, ev.group, h)
            n = self._refs.get(key, 0)
            self._refs[key] = n + 1
            if n == 0:  # a copy in another tier keeps the content first seen (see the docstring)
                mine = self._ours.setdefault((ev.group, h), tuple(ours[i * per : (i + 1) * per]))
                added += self._hold(ev.medium, mine)
        self.stats.stored_blocks += len(ev.hashes)
        return added

    def _removed(self, ev: Removed) -> list[int]:
        gone: list[int] = []
        for h in ev.hashes:
            key = (ev.medium, ev.group, h)
            n = self._refs.get(key)
            if n is None:
                continue
            self.stats.removed_blocks += 1
            if n > 1:
                self._refs[key] = n - 1
                continue
            del self._refs[key]
            mine = self._ours[ev.group, h]
            if not any((m, ev.group, h) in self._refs for m in MEDIA):
                del self._ours[ev.group, h]
            for ours in mine:
                c = self._count[ev.medium, ours] - 1
                if c:
                    self._count[ev.medium, ours] = c
                else:
                    del self._count[ev.medium, ours]
                    gone.append(ours)
        return gone

    def _hold(self, medium: str, hashes: tuple[int, ...]) -> list[int]:
        fresh = []
        for h in hashes:
            c = self._count.get((medium, h), 0)
            self._count[medium, h] = c + 1
            if c == 0:
                fresh.append(h)
        return fresh

    def _skipped(self, why: str, n: int) -> list[int]:
        """Count `n` blocks left out, by reason; past `MAX_REASONS` distinct reasons (a reason
        may name a publisher's field or medium) a new one counts as "other". A reason is cut to
        MAX_REASON_LEN: one naming a publisher's every field, kept for good, could be megabytes."""
        self.stats.skipped_blocks += n
        reasons = self.stats.reasons
        why = why[:MAX_REASON_LEN]
        if why not in reasons and len(reasons) >= MAX_REASONS:
            why = "other"
        reasons[why] = reasons.get(why, 0) + n
        return []
