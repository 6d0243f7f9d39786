"""A worker's NIXL agent (UCX backend) with its whole KV cache tensor (CPU or GPU memory)
registered, and the one operation P/D needs of it: a WRITE of local blocks into a peer's, by
descriptor (one per layer, K or V, and run of consecutive block ids on both sides). The
protocol around it (reserve, write, commit, quarantine) is workers/transfer_nixl.py.
"""

import base64
import logging
import threading
import time

import numpy as np

from workers.nixl_layout import CacheLayout

log = logging.getLogger("kvgate.transfer")


def nixl_module():
    """The NIXL Python package of the installed wheel (`nixl-cu12` or `nixl-cu13`), or None."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            return __import__(name)
        except ImportError:
            continue
    return None


class NixlError(RuntimeError):
    """A failed WRITE; `settled` when nothing of it can still be in flight (it never started, or
    NIXL reported its end), else its bytes may land later."""

    def __init__(self, message: str, settled: bool = True):
        super().__init__(message)
        self.settled = settled


def block_runs(local: list[int], remote: list[int]) -> tuple[list[int], list[int], np.ndarray]:
    """Split a block-to-block mapping into runs consecutive on both sides: (local starts, remote
    starts, lengths). Freshly allocated blocks mostly come in order, so a transfer is a few
    large descriptors per slice rather than one per block."""
    ls, rs, lens = [], [], []
    for i, (a, b) in enumerate(zip(local, remote)):
        if i and a == local[i - 1] + 1 and b == remote[i - 1] + 1:
            lens[-1] += 1
        else:
            ls.append(a)
            rs.append(b)
            lens.append(1)
    return ls, rs, np.asarray(lens, dtype=np.uint64)


class NixlAgent:
    """A NIXL agent (UCX) with one worker's KV cache registered."""

    def __init__(self, name: str, kv_cache):
        nixl = nixl_module()
        if nixl is None:
            raise NixlError("NIXL is not installed (pip install 'kvgate[nixl]')")
        if not kv_cache.is_contiguous() or kv_cache.dim() < 3:
            raise NixlError("the KV cache must be one contiguous [layers, 2, blocks, ...] tensor")
        # No progress thread: NIXL's spins a whole core even when idle. A writer progresses while it
        # polls its transfer, a target while it holds reservations (NixlTransfer._progress_loop).
        conf = nixl.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = nixl.nixl_agent(name, conf)
        self.name = name
        self.kv_cache = kv_cache
        self.registered = self.agent.register_memory(kv_cache)
        layers, two, num_blocks = kv_cache.shape[:3]
        cuda = kv_cache.device.type == "cuda"
        self.layout = CacheLayout(
            name,
            base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "VRAM" if cuda else "DRAM",
            kv_cache.get_device() if cuda else 0,
            kv_cache.data_ptr(),
            num_blocks,
            layers * two,
            kv_cache[0, 0, 0].numel() * kv_cache.element_size(),
        )
        self._peers: set[str] = set()
        self._peers_lock = threading.Lock()  # batches of one prompt write from several threads

    def connect(self, peer: CacheLayout) -> None:
        """Load a peer's metadata once (a restarted peer has a new agent name)."""
        with self._peers_lock:
            if peer.agent not in self._peers:
                self.agent.add_remote_agent(base64.b64decode(peer.metadata))
                self._peers.add(peer.agent)

    def progress(self) -> None:
        """Drive the backend once: over emulated transports (UCX over TCP) a WRITE into this
        agent's memory completes only while its side progresses."""
        self.agent.get_new_notifs()

    def forget(self, agent: str) -> None:
        with self._peers_lock:
            known = agent in self._peers
            self._peers.discard(agent)
        if known:
            try:
                self.agent.remove_remote_agent(agent)
            except Exception as e:  # a peer that is gone may not disconnect cleanly
                log.debug("forgetting NIXL peer %s: %r", agent, e)

    def write(self, peer: CacheLayout, local: list[int], remote: list[int], deadline: float) -> int:
        """WRITE our blocks `local` into the peer's blocks `remote` by `deadline` (monotonic);
        returns the bytes moved. Blocking (run it on a thread); raises NixlError on a failed or
        timed-out transfer, and without posting anything once the deadline has passed (the
        peer's reservation may be gone: its blocks are no longer ours to write)."""
        mine = self.layout
        if (peer.num_slices, peer.slice_bytes) != (mine.num_slices, mine.slice_bytes):
            raise NixlError(
                f"peer cache layout {peer.num_slices}x{peer.slice_bytes} B does not match "
                f"ours {mine.num_slices}x{mine.slice_bytes} B"
            )
        if not local:
            return 0
        if time.monotonic() >= deadline:
            raise NixlError(f"the reservation at {peer.agent} is too old to write into")
        ls, rs, lens = block_runs(local, remote)
        try:
            self.connect(peer)
            src = self.agent.get_xfer_descs(mine.descs(ls, lens), mine.mem)
            dst = self.agent.get_xfer_descs(peer.descs(rs, lens), peer.mem)
            handle = self.agent.initialize_xfer("WRITE", src, dst, peer.agent)
        except Exception as e:  # the bindings raise their own errors (an unreachable peer: NIXL_ERR_BACKEND)
            raise NixlError(f"cannot start a NIXL WRITE to {peer.agent}: {e!r}") from e
        state = "PROC"
        try:
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
        except Exception as e:
            raise NixlError(f"NIXL WRITE to {peer.agent} failed: {e!r}", settled=False) from e
        finally:
            try:
                handle.release()  # tries to cancel a transfer in progress; its bytes may still land
            except Exception as e:
                log.warning("NIXL could not release a WRITE to %s: %r", peer.agent, e)
        if state == "PROC":
            raise NixlError(f"NIXL WRITE to {peer.agent} timed out", settled=False)
        if state != "DONE":
            raise NixlError(f"NIXL WRITE to {peer.agent} ended {state}")
        return len(local) * mine.num_slices * mine.slice_bytes
