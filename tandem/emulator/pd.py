"""P/D disaggregation as vLLM's NixlConnector does it: kv_transfer_params, leases, NIXL pulls.

Prefill side (`do_remote_decode`): the finished request's blocks are held for a lease, their
bytes (a deterministic pattern per block) sit in a NIXL-registered buffer, and the response
carries kv_transfer_params pointing at this engine's side channel.
Decode side (`do_remote_prefill`): the engine handshakes with the prefill engine over its side
channel (ZMQ REQ/REP, msgpack: agent metadata, buffer layout, engine id), asks whether the lease
is still held, READs the blocks it does not have cached through NIXL, checks their bytes, and then
lets the scheduler compute the last prompt token. The simulated transfer time
(profile.transfer_seconds of the pulled tokens, over the speed-up) counts in TTFT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from tandem.emulator.errors import INTERNAL_ERROR
from tandem.emulator.kv_cache import Block
from tandem.emulator.request import EngineRequest, RemotePrefill

if TYPE_CHECKING:
    from tandem.emulator.engine import EmulatedEngine

log = logging.getLogger("tandem.emulator.pd")


class KVTransferError(Exception):
    """A failed KV load. The client sees vLLM's "Internal server error" unless `client_message`
    says more (cases vLLM does not detect, such as an expired lease)."""

    def __init__(self, message: str, client_message: str = INTERNAL_ERROR) -> None:
        super().__init__(message)
        self.client_message = client_message


@dataclass
class RemoteEngine:
    engine_id: str
    agent_name: str
    host: str
    port: int
    base_addr: int
    block_bytes: int
    num_blocks: int
    block_size: int


@dataclass
class Lease:
    request_id: str
    blocks: list[Block]
    expires_at: float
    timer: asyncio.TimerHandle | None = None


def side_channel_address() -> tuple[str, int]:
    """VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT, as vLLM reads them (defaults localhost:5600)."""
    host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
    port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    return host, port


def parse_remote_prefill(params: dict[str, Any]) -> RemotePrefill:
    """The decode side's view of the prefill engine's kv_transfer_params; ValueError if incomplete."""
    missing = [
        key
        for key in (
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
        )
        if params.get(key) is None
    ]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {', '.join(missing)}")
    groups = params["remote_block_ids"]
    block_ids = groups[0] if groups and isinstance(groups[0], list) else groups
    return RemotePrefill(
        engine_id=str(params["remote_engine_id"]),
        host=str(params["remote_host"]),
        port=int(params["remote_port"]),
        block_ids=[int(b) for b in block_ids],
        request_id=str(params["remote_request_id"]),
        num_tokens=int(params.get("remote_num_tokens") or 0),
    )


def block_pattern(tokens: list[int], block_index: int) -> int:
    """The 64-bit word a prefill engine fills a block with: a checksum of the block's tokens."""
    crc = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes())
    return (crc << 32) | (block_index & 0xFFFFFFFF) | 1


class PDConnector:
    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine
        config = engine.config
        assert config.kv_transfer_config is not None
        self.kv_config = config.kv_transfer_config
        self.lease_s = self.kv_config.lease_seconds
        self.handshake_timeout = config.kv_handshake_timeout_s
        host, port = side_channel_address()
        self.host = host
        self.port = port + config.data_parallel_rank
        self.block_size = config.block_size
        per_token = engine.profile.emulated_bytes_per_token()
        self.block_bytes = max(8, (per_token * self.block_size + 7) // 8 * 8)
        self.num_blocks = engine.num_gpu_blocks
        self.buffer = np.zeros(self.num_blocks * self.block_bytes // 8, dtype=np.uint64)
        self.words_per_block = self.block_bytes // 8
        self.agent_name = f"{engine.engine_id}-{uuid.uuid4().hex[:8]}"
        self.agent: Any = None
        self.remotes: dict[str, RemoteEngine] = {}
        self.leases: dict[str, Lease] = {}
        self.ctx = zmq.asyncio.Context()
        self.rep: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._handshake_locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.agent = await loop.run_in_executor(None, self._make_agent)
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.rep.setsockopt(zmq.LINGER, 0)
        bind_host = "*" if self.host in ("0.0.0.0", "") else self.host
        if bind_host == "localhost":
            bind_host = "127.0.0.1"
        self.rep.bind(f"tcp://{bind_host}:{self.port}")
        self._tasks.append(loop.create_task(self._serve_side_channel()))
        self._tasks.append(loop.create_task(self._poll_notifications()))
        log.info(
            "NIXL side channel on %s:%d, engine %s", self.host, self.port, self.engine.engine_id
        )

    def _make_agent(self) -> Any:
        if not self.engine.config.use_nixl:
            return None
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError:
            log.warning(
                "NIXL is not installed: P/D runs on metadata and timing only, no bytes move"
            )
            return None
        agent = nixl_agent(
            self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        descs = np.array([[self.buffer.ctypes.data, self.buffer.nbytes, 0]])
        agent.register_memory(descs, "DRAM")
        return agent

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.rep is not None:
            self.rep.close(0)
        self.ctx.term()

    # ------------------------------------------------------------------ prefill side
    def kv_transfer_params(self, request: EngineRequest, block_ids: list[int]) -> dict[str, Any]:
        """vLLM's response kv_transfer_params for a finished do_remote_decode request."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.engine.config.tensor_parallel_size,
            "dcp_size": 1,
            "pp_size": self.engine.config.pipeline_parallel_size,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": max(request.num_cached_tokens, 0),
        }

    def hold_blocks(self, request: EngineRequest) -> None:
        """Keep a finished prefill's blocks for the decode engine, until read or lease expiry."""
        blocks = self.engine.kv.detach(request)
        bs = self.block_size
        prompt = request.prompt_token_ids
        wpb = self.words_per_block
        for index, block in enumerate(blocks):
            start = block.block_id * wpb
            self.buffer[start : start + wpb] = block_pattern(
                prompt[index * bs : (index + 1) * bs], index
            )
        loop = asyncio.get_running_loop()
        lease = Lease(request.request_id, blocks, time.time() + self.lease_s)
        lease.timer = loop.call_later(self.lease_s, self._expire, request.request_id)
        self.leases[request.request_id] = lease
        request.extra["kv_transfer_params"] = self.kv_transfer_params(
            request, [b.block_id for b in blocks]
        )

    def _expire(self, request_id: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return
        log.warning(
            "Releasing expired KV blocks for request %s which were retrieved by 0 remote worker(s) "
            "before lease expired.",
            request_id,
        )
        self.engine.metrics.nixl_kv_expired.inc()
        self.engine.kv.release(lease.blocks)
        self.engine.wake()

    def _release(self, request_id: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            self.engine.metrics.nixl_notifications_after_expiry.inc()
            return
        if lease.timer is not None:
            lease.timer.cancel()
        self.engine.kv.release(lease.blocks)
        self.engine.wake()

    async def _poll_notifications(self) -> None:
        while True:
            await asyncio.sleep(0.002 if self.leases else 0.02)
            if not self.leases or self.agent is None:
                continue
            notifs = self.agent.get_new_notifs()
            for messages in notifs.values():
                for message in messages:
                    self._release(bytes(message).decode())

    async def _serve_side_channel(self) -> None:
        assert self.rep is not None
        decoder = msgspec.msgpack.Decoder()
        encoder = msgspec.msgpack.Encoder()
        while True:
            frames = await self.rep.recv_multipart()
            identity, body = frames[0], frames[-1]
            try:
                message = decoder.decode(body)
                reply = self._answer(message)
            except Exception as error:  # a malformed peer message must not stop the channel
                reply = {"error": str(error)}
            await self.rep.send_multipart((identity, b"", encoder.encode(reply)))

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        if op == "handshake":
            return {
                "engine_id": self.engine.engine_id,
                "agent_name": self.agent_name,
                "agent_metadata": self.agent.get_agent_metadata()
                if self.agent is not None
                else b"",
                "base_addr": int(self.buffer.ctypes.data),
                "block_bytes": self.block_bytes,
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "tp_size": self.engine.config.tensor_parallel_size,
            }
        if op == "lease":
            lease = self.leases.get(str(message.get("request_id")))
            return {"held": lease is not None}
        if op == "release":  # the KV was taken without a NIXL notification
            self._release(str(message.get("request_id")))
            return {"released": True}
        return {"error": f"unknown op {op!r}"}

    # ------------------------------------------------------------------ decode side
    def start_pull(self, request: EngineRequest, num_hit: int) -> None:
        asyncio.get_running_loop().create_task(self._pull(request, num_hit))

    async def _request(self, host: str, port: int, message: dict[str, Any]) -> dict[str, Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            connect_host = "127.0.0.1" if host == "localhost" else host
            sock.connect(f"tcp://{connect_host}:{port}")
            await sock.send_multipart((b"", msgspec.msgpack.encode(message)))
            frames = await asyncio.wait_for(sock.recv_multipart(), self.handshake_timeout)
            reply = msgspec.msgpack.decode(frames[-1])
            if not isinstance(reply, dict):
                raise KVTransferError("malformed side channel reply")
            return reply
        except TimeoutError as error:
            raise KVTransferError(
                f"no answer from the NIXL side channel {host}:{port} within {self.handshake_timeout} s"
            ) from error
        finally:
            sock.close(0)

    async def _remote(self, remote: RemotePrefill) -> RemoteEngine:
        """The handshaked peer for an engine id; like vLLM, a known engine's host/port are not re-read."""
        known = self.remotes.get(remote.engine_id)
        if known is not None:
            return known
        lock = self._handshake_locks.setdefault(remote.engine_id, asyncio.Lock())
        async with lock:
            known = self.remotes.get(remote.engine_id)
            if known is not None:
                return known
            reply = await self._request(remote.host, remote.port, {"op": "handshake"})
            if reply.get("engine_id") != remote.engine_id:
                raise KVTransferError(
                    f"Remote NIXL agent engine ID mismatch. Expected {remote.engine_id},"
                    f"received {reply.get('engine_id')}."
                )
            if reply.get("block_size") != self.block_size:
                raise KVTransferError(
                    f"block size mismatch: local {self.block_size}, remote {reply.get('block_size')}"
                )
            if reply.get("block_bytes") != self.block_bytes:
                raise KVTransferError(
                    f"KV layout mismatch: local {self.block_bytes} B/block, remote {reply.get('block_bytes')}"
                )
            name: Any = ""
            if self.agent is not None and reply.get("agent_metadata"):
                loop = asyncio.get_running_loop()
                name = await loop.run_in_executor(
                    None, self.agent.add_remote_agent, reply["agent_metadata"]
                )
            peer = RemoteEngine(
                engine_id=remote.engine_id,
                agent_name=name.decode() if isinstance(name, bytes) else str(name),
                host=remote.host,
                port=remote.port,
                base_addr=int(reply["base_addr"]),
                block_bytes=int(reply["block_bytes"]),
                num_blocks=int(reply["num_blocks"]),
                block_size=int(reply["block_size"]),
            )
            self.remotes[remote.engine_id] = peer
            return peer

    async def _pull(self, request: EngineRequest, num_hit: int) -> None:
        engine = self.engine
        metrics = engine.metrics
        remote = request.remote_prefill
        assert remote is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            peer = await self._remote(remote)
            lease = await self._request(
                peer.host, peer.port, {"op": "lease", "request_id": remote.request_id}
            )
            if not lease.get("held"):
                message = (
                    f"KV transfer failed: the KV blocks of request {remote.request_id} are not held by "
                    f"prefill engine {remote.engine_id} (lease expired, already read, or unknown request)"
                )
                raise KVTransferError(message, message)
            bs = self.block_size
            first = num_hit // bs
            last = -(-request.num_prompt_tokens // bs)
            if len(remote.block_ids) < last:
                raise KVTransferError(
                    f"remote_block_ids has {len(remote.block_ids)} blocks, the prompt needs {last}"
                )
            local_ids = engine.kv.block_ids(request)[first:last]
            remote_ids = remote.block_ids[first:last]
            num_tokens = request.num_prompt_tokens - first * bs
            if not peer.agent_name or self.agent is None:
                # no NIXL on one side: no bytes move; tell the prefill engine the KV was taken
                await self._request(
                    peer.host, peer.port, {"op": "release", "request_id": remote.request_id}
                )
            elif local_ids:
                moved, post_s, xfer_s = await self._read(
                    peer, local_ids, remote_ids, remote.request_id
                )
                metrics.nixl_bytes.observe(moved)
                metrics.nixl_post_time.observe(post_s)
                metrics.nixl_xfer_time.observe(xfer_s)
                metrics.nixl_descriptors.observe(2 * len(local_ids))
                self._verify(request, first, local_ids)
            simulated = engine.profile.transfer_seconds(num_tokens) / engine.speedup
            remaining = simulated - (loop.time() - started)
            if remaining > 0:
                await asyncio.sleep(remaining)
        except KVTransferError as error:
            metrics.nixl_failed_transfers.inc()
            log.error("NIXL transfer failure for request %s: %s", request.request_id, error)
            self._after_failed_pull(request, error.client_message)
            return
        except Exception:  # NIXL and ZMQ raise their own exception types
            metrics.nixl_failed_transfers.inc()
            log.exception("NIXL transfer failure for request %s", request.request_id)
            self._after_failed_pull(request, INTERNAL_ERROR)
            return
        if request.finished:
            return
        request.num_external_tokens = request.num_prompt_tokens - num_hit
        request.kv_ready = True
        engine.wake()

    def _after_failed_pull(self, request: EngineRequest, message: str) -> None:
        """`kv_load_failure_policy`: `fail` ends the request with `message`; `recompute` hands it
        back to the scheduler, which prefills the prompt here."""
        if self.kv_config.kv_load_failure_policy == "recompute" and not request.finished:
            request.kv_failed = True
            request.kv_ready = True
            self.engine.wake()
        else:
            self.engine.fail(request, message)

    async def _read(
        self, peer: RemoteEngine, local_ids: list[int], remote_ids: list[int], notif: str
    ) -> tuple[int, float, float]:
        """NIXL READ of whole blocks; returns (bytes, post seconds, transfer seconds)."""
        agent = self.agent
        size = self.block_bytes
        base = int(self.buffer.ctypes.data)
        local = np.array([[base + b * size, size, 0] for b in local_ids], dtype=np.uint64)
        remote = np.array(
            [[peer.base_addr + b * size, size, 0] for b in remote_ids], dtype=np.uint64
        )
        for block_id in remote_ids:
            if not 0 <= block_id < peer.num_blocks:
                raise KVTransferError(f"remote block id {block_id} out of range")
        t0 = time.perf_counter()
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, "DRAM"),
            peer.agent_name,
            notif.encode(),
        )
        state = agent.transfer(handle)
        post_s = time.perf_counter() - t0
        deadline = time.monotonic() + self.handshake_timeout
        try:
            while state != "DONE":
                if state == "ERR":
                    raise KVTransferError("NIXL transfer reported an error")
                if time.monotonic() > deadline:
                    raise KVTransferError("NIXL transfer timed out")
                await asyncio.sleep(0.0002)
                state = agent.check_xfer_state(handle)
        finally:
            agent.release_xfer_handle(handle)
        return size * len(local_ids), post_s, time.perf_counter() - t0

    def _verify(self, request: EngineRequest, first: int, local_ids: list[int]) -> None:
        """The pulled bytes must be the prefill engine's pattern for these prompt blocks."""
        bs = self.block_size
        wpb = self.words_per_block
        prompt = request.prompt_token_ids
        for offset, block_id in enumerate(local_ids):
            index = first + offset
            expected = block_pattern(prompt[index * bs : (index + 1) * bs], index)
            words = self.buffer[block_id * wpb : (block_id + 1) * wpb]
            if not bool((words == np.uint64(expected)).all()):
                message = (
                    f"KV transfer failed: the pulled KV of block {index} does not belong to this "
                    "prompt (stale or foreign kv_transfer_params)"
                )
                raise KVTransferError(message, message)
