"""The tensor-parallel rendezvous and step channel against a client without the group's secret.

The store listens on the rendezvous address only; a client that reaches it
can neither join the group nor move a rank; step messages are HMAC-checked
before anything of them is decoded, and never unpickled.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from pagefleet.engine import LLMEngine, SamplingParams, step_codec
from pagefleet.engine import distributed as d
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.model_runner import ModelRunner, StepInputs
from pagefleet.engine.step_codec import StepDecodeError, decode_step, encode_step
from pagefleet.kernels import AttentionMetadata, build_attention_metadata
from tests.conftest import prompt_ids

_T = timedelta(seconds=5)


def _attacker(rendezvous: d.Rendezvous) -> dist.TCPStore:
    """A client that reaches the store but was never told the secret."""
    return dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False, timeout=_T)


def _step(padded: bool = True) -> StepInputs:
    """Two decodes and two prompt chunks, as the model runner lays them out."""
    meta = build_attention_metadata(
        [1, 1, 5, 3], [7, 9, 5, 20], [[0, 1], [2, 3], [4], [5, 6, 7]], 8, padded=padded
    )
    return StepInputs(
        input_ids=torch.arange(100, 110),
        positions=torch.tensor([6, 8, 0, 1, 2, 3, 4, 17, 18, 19]),
        meta=meta,
        blocks_to_copy=[(3, 9), (4, 10)],
        logit_rows=torch.tensor([0, 1, 6, 9]),
    )


def _fields(inputs: StepInputs) -> dict[str, Any]:
    """Every field of a step, tensors as (dtype, shape, values): what must survive the wire."""
    out: dict[str, Any] = {"blocks_to_copy": inputs.blocks_to_copy}
    meta = {f.name: getattr(inputs.meta, f.name) for f in dataclasses.fields(inputs.meta) if f.init}
    for name, value in {**vars(inputs), **meta}.items():
        if name == "meta":
            continue
        if isinstance(value, torch.Tensor):
            value = (str(value.dtype), tuple(value.shape), value.tolist())
        out[name] = value
    return out


# (d) the store listens on the rendezvous address only


def _listening_ips(port: int) -> list[str]:
    return [
        c.laddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def test_the_store_listens_on_the_rendezvous_address_only() -> None:
    """Bound to the address the ranks are told, not every interface. Two loopback
    addresses stand in for a node's two interfaces (tests reach no other address)."""
    for own, other in (("127.0.0.1", "127.0.0.2"), ("127.0.0.2", "127.0.0.1")):
        master, rendezvous = d.open_rendezvous(own, 2)
        assert _listening_ips(rendezvous.port) == [own]
        assert _connects(own, rendezvous.port)
        assert not _connects(other, rendezvous.port)
        assert not _connects("::1", rendezvous.port)
        client = d.SealedStore(dist.TCPStore(own, rendezvous.port, timeout=_T), rendezvous.secret)
        client.set("k", b"v")
        assert d.SealedStore(master, rendezvous.secret).get("k") == b"v"


def test_each_rendezvous_has_its_own_secret_and_never_prints_it() -> None:
    _m1, first = d.open_rendezvous("127.0.0.1", 2)
    _m2, second = d.open_rendezvous("127.0.0.1", 2)
    assert len(first.secret) == 32 and first.secret != second.secret
    assert first.secret.hex() not in repr(first) and repr(first.secret) not in repr(first)
    assert "secret" not in repr(first)


# (a) a client without the secret cannot join the group or move a rank


def test_a_client_without_the_secret_cannot_complete_the_join(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 waiting for rank 1 is not fooled by anything written without the secret."""
    monkeypatch.setattr(d, "STARTUP_TIMEOUT", timedelta(seconds=1))
    joined: list[object] = []
    monkeypatch.setattr(d.dist, "init_process_group", lambda *a, **kw: joined.append(kw))
    _master, rendezvous = d.open_rendezvous("127.0.0.1", 2)
    attacker = _attacker(rendezvous)
    # What the old rendezvous counted, its guessed per-rank keys, and the sealed view's keys
    # computed with a wrong secret.
    attacker.add("pagefleet/joined", 5)
    for key in ("pagefleet/joined/1", "pagefleet/ready/1", "default_pg/0//cpu//0/1"):
        attacker.set(key, b"")
    d.SealedStore(attacker, os.urandom(32)).set("pagefleet/joined/1", b"")
    with pytest.raises(TimeoutError, match=r"^tensor-parallel ranks joined: 1 of 2 within"):
        d.init_tp(0, 2, rendezvous, "cpu")
    assert joined == []  # never reached the process group


def test_store_keys_are_opaque_and_values_written_without_the_secret_are_refused() -> None:
    _master, rendezvous = d.open_rendezvous("127.0.0.1", 2)
    sealed = d.SealedStore(
        dist.TCPStore("127.0.0.1", rendezvous.port, timeout=_T), rendezvous.secret
    )
    sealed.set("pagefleet/step/1", b"")
    sealed.set("gloo/address", b"10.0.0.1:1234")
    attacker = _attacker(rendezvous)
    names = attacker.list_keys()
    assert len(names) == 2
    for name in names:  # HMACs of the names: nothing to tell them apart by, nothing to guess
        assert name.startswith("pf/") and len(name) == 3 + 64 and "pagefleet" not in name
        attacker.set(name, b"\0" * 32 + b"10.6.6.6:1234")  # valid length, forged tag
    with pytest.raises(d.StoreTamperedError, match="failed its HMAC check"):
        sealed.get("gloo/address")


def _rank_one(rendezvous: d.Rendezvous, results: mp.Queue) -> None:
    """Rank 1 of the group fixture: the real join and `next_step`, reporting every outcome.

    It goes on after a refused message (a real rank stops: `run_rank` lets the error out)
    so that one group serves a whole test; `decoded` counts the payloads that reached the
    decoder.
    """
    decoded = 0
    d.init_tp(1, 2, rendezvous, "cpu")
    try:
        while True:
            try:
                payload = d.next_step()
            except d.StepAuthenticationError as e:
                results.put(("refused", str(e), decoded))
                continue
            decoded += 1
            inputs = decode_step(payload)
            if inputs is None:
                results.put(("stop", None, decoded))
                return
            results.put(("step", _fields(inputs), decoded))
    finally:
        d.destroy_tp()


@dataclasses.dataclass
class Group:
    master: dist.TCPStore
    rendezvous: d.Rendezvous
    results: mp.Queue
    rank_one: Any  # its multiprocessing Process

    def post_raw(self, header: bytes, payload: bytes | None) -> None:
        """Announce the next step and broadcast these bytes as its message, as rank 0."""
        d._STEP += 1
        assert d._STORE is not None
        d._STORE.set(f"pagefleet/step/{d._STEP}", b"")
        d._broadcast_bytes(header, len(header))
        if payload is not None:
            d._broadcast_bytes(payload, len(payload))

    def result(self) -> tuple[str, Any, int]:
        return self.results.get(timeout=30)


@pytest.fixture
def group() -> Iterator[Group]:
    """Rank 0 here, rank 1 in a spawned process, joined through a real rendezvous.

    One group per test: while it exists this process is a TP rank (layers all-reduce).
    """
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("PAGEFLEET_TP_TIMEOUT_S", "15")  # a broken test fails fast, both ranks
        master, rendezvous = d.open_rendezvous("127.0.0.1", 2)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        rank_one = ctx.Process(target=_rank_one, args=(rendezvous, results), daemon=True)

        def exited() -> str | None:
            code = rank_one.exitcode
            return None if code is None else f"rank 1 exited: {code}"

        rank_one.start()
        try:
            d.init_tp(0, 2, rendezvous, "cpu", failed=exited)
            yield Group(master, rendezvous, results, rank_one)
            d.post_step(encode_step(None))
            assert results.get(timeout=30)[0] == "stop"
        finally:
            d.destroy_tp()
            rank_one.join(10)
            if rank_one.is_alive():
                rank_one.kill()


def test_steps_posted_without_the_secret_move_no_rank(group: Group) -> None:
    attacker = _attacker(group.rendezvous)
    for key in attacker.list_keys():
        assert group.rendezvous.secret not in attacker.get(key)  # it never went through the store
    # The old step keys, and every key it can see overwritten.
    for n in range(1, 20):
        attacker.set(f"pagefleet/step/{n}", b"")
    for key in attacker.list_keys():
        if key.startswith("pf/"):
            attacker.set(key, b"go")
    with pytest.raises(queue.Empty):
        group.results.get(timeout=1.5)  # rank 1 still waits for rank 0's next step
    assert group.rank_one.is_alive()
    step = _step()
    d.post_step(encode_step(step))
    kind, fields, _ = group.result()
    assert (kind, fields) == ("step", _fields(step))


def test_forged_tampered_and_replayed_steps_are_refused_before_decoding(group: Group) -> None:
    payload = encode_step(_step())
    secret = group.rendezvous.secret
    # Valid framing, HMAC under a guessed secret: refused at the header, payload never sent.
    forged = d.seal_step(payload, os.urandom(32), d._STEP + 1)
    group.post_raw(forged[: d.HEADER_SIZE], None)
    kind, reason, decoded = group.result()
    assert kind == "refused" and "message header failed its HMAC check" in reason
    # One payload byte flipped after sealing: the header is genuine, the payload is not.
    genuine = bytearray(d.seal_step(payload, secret, d._STEP + 1))
    genuine[-5] ^= 0x01
    group.post_raw(bytes(genuine[: d.HEADER_SIZE]), bytes(genuine[d.HEADER_SIZE :]))
    kind, reason, again = group.result()
    assert kind == "refused" and "message payload failed its HMAC check" in reason
    # A genuine message of an earlier step, replayed.
    old = d.seal_step(payload, secret, d._STEP)
    group.post_raw(old[: d.HEADER_SIZE], None)
    kind, reason, replayed = group.result()
    assert kind == "refused" and "header failed" in reason
    assert decoded == again == replayed  # none of them reached the decoder
    # The rank is still in step with rank 0 and runs a genuine step.
    d.post_step(payload)
    kind, fields, after = group.result()
    assert (kind, fields, after) == ("step", _fields(_step()), decoded + 1)


# (b) forgeries refused by the message check itself; (c) the encoding round trip


def test_every_flipped_byte_of_a_message_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = os.urandom(32)
    payload = encode_step(_step(padded=False))
    message = d.seal_step(payload, secret, 7)
    assert d.open_step(message, secret, 7) == payload
    decodes: list[bytes] = []
    monkeypatch.setattr(step_codec, "decode_step", decodes.append)
    for i in range(len(message)):
        tampered = bytearray(message)
        tampered[i] ^= 0x80
        with pytest.raises(d.StepAuthenticationError, match="failed its HMAC check"):
            d.open_step(bytes(tampered), secret, 7)
    for bad in (message[:-1], message + b"\0", message[: d.HEADER_SIZE - 1]):
        with pytest.raises(d.StepAuthenticationError):
            d.open_step(bad, secret, 7)
    with pytest.raises(d.StepAuthenticationError):
        d.open_step(message, secret, 8)  # replayed at another step
    with pytest.raises(d.StepAuthenticationError):
        d.open_step(message, os.urandom(32), 7)
    assert decodes == []


@pytest.mark.parametrize("padded", [True, False], ids=["cpu-layouts", "cuda-layouts"])
def test_a_step_round_trips_exactly(padded: bool) -> None:
    step = _step(padded)
    back = decode_step(encode_step(step))
    assert isinstance(back, StepInputs) and isinstance(back.meta, AttentionMetadata)
    assert _fields(back) == _fields(step)
    assert back.meta.padded == padded
    assert decode_step(encode_step(None)) is None


def test_the_model_runners_own_steps_round_trip_exactly(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real steps (prefill, decodes, prompt logprobs) as the model runner builds them."""
    seen: list[StepInputs] = []
    forward = ModelRunner.forward

    def recording(self: ModelRunner, inputs: StepInputs, copy_blocks: bool = True) -> torch.Tensor:
        seen.append(inputs)
        return forward(self, inputs, copy_blocks)

    monkeypatch.setattr(ModelRunner, "forward", recording)
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=32, block_size=8))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    for i, prompt in enumerate(prompt_ids(llama_dir)[:3]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    assert len(seen) >= 3
    for step in seen:
        assert _fields(decode_step(encode_step(step))) == _fields(step)


def test_the_schema_covers_every_field_of_a_step() -> None:
    meta = {f.name for f in dataclasses.fields(AttentionMetadata) if f.init}
    coded = set(step_codec.TENSORS) - set(step_codec.STEP_TENSORS)
    assert coded | set(step_codec.INTS) == meta
    step = {f.name for f in dataclasses.fields(StepInputs)}
    assert set(step_codec.STEP_TENSORS) | {"meta", "blocks_to_copy"} == step


def _mutated(payload: bytes, change: Any) -> bytes:
    """`payload` with its JSON head changed by `change(head)`."""
    import json
    import struct

    (n,) = struct.unpack_from(">I", payload)
    head = json.loads(payload[4 : 4 + n])
    change(head)
    text = json.dumps(head).encode()
    return struct.pack(">I", len(text)) + text + payload[4 + n :]


@pytest.mark.parametrize(
    "change",
    [
        lambda h: h["ints"].update(max_query_len=True),  # a bool is no count
        lambda h: h["ints"].update(num_decode_tokens=-1),
        lambda h: h["ints"].update(max_query_len="5"),
        lambda h: h.update(blocks_to_copy=[[1, 2, 3]]),
        lambda h: h.update(extra=1),
        lambda h: h["shapes"].update(input_ids=[11]),  # more bytes than are there
        lambda h: h["shapes"].update(block_tables=[32]),  # wrong rank
        lambda h: h["shapes"].update(input_ids=None),  # a required tensor missing
        lambda h: h["shapes"].update(prefill_mask=None),  # half the padded layouts
        lambda h: h.update(stop=1),
    ],
)
def test_the_decoder_checks_every_field(change: Any) -> None:
    with pytest.raises(StepDecodeError):
        decode_step(_mutated(encode_step(_step()), change))


def test_the_decoder_refuses_trailing_bytes_and_non_boolean_masks() -> None:
    payload = encode_step(_step())
    with pytest.raises(StepDecodeError, match="trailing"):
        decode_step(payload + b"\0")
    with pytest.raises(StepDecodeError, match="bool"):
        decode_step(payload[:-1] + b"\x02")  # the last byte is prefill_mask's
