"""Tensor links between two endpoints (threads and Ray tasks here; actors in test_runtime.py):
tensors arrive intact and in order, sends can stay in flight, a vanished peer is a prompt
`LinkError`, and GPU tensors cross a gloo link through host memory (the CUDA cases run where a
GPU is)."""

from __future__ import annotations

import contextlib
import threading
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

from cluster.links import LinkError, TensorLink, link_backend

needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def pair(name: str, timeout_s: float = 5.0) -> tuple[TensorLink, TensorLink]:
    host = TensorLink.host(name, timeout_s=timeout_s)
    joined: dict[str, TensorLink] = {}
    thread = threading.Thread(
        target=lambda: joined.setdefault("peer", TensorLink.join(host.address, timeout_s))
    )
    thread.start()
    host.connect()
    thread.join()
    return host, joined["peer"]


def test_tensors_arrive_in_order_with_sends_in_flight() -> None:
    host, peer = pair("order")
    sent = [
        torch.arange(6, dtype=dtype).reshape(2, 3) * (i + 1)
        for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64])
    ]
    for tensor in sent:
        host.send(tensor, wait=False)  # the peer has not posted a receive yet
    got = [peer.recv((2, 3), t.dtype) for t in sent]
    host.flush()
    for want, have in zip(sent, got, strict=True):
        assert torch.equal(want, have)
    # And back the other way (a send completes only once the receive is posted).
    peer.send(torch.ones(4), wait=False)
    assert torch.equal(host.recv((4,), torch.float32), torch.ones(4))
    peer.flush()


def test_nccl_carries_a_link_only_between_gpus() -> None:
    assert link_backend("cpu") == link_backend("cpu", "cpu") == "gloo"
    assert link_backend("cuda", "cpu") == link_backend(torch.device("cpu"), "cuda") == "gloo"
    nccl = "nccl" if dist.is_nccl_available() else "gloo"
    assert link_backend("cuda", torch.device("cuda", 0)) == nccl


@pytest.mark.parametrize("device", DEVICES)
def test_a_gloo_link_moves_tensors_of_any_device(device: str) -> None:
    host, peer = pair(f"devices-{device}")
    assert host.device.type == peer.device.type == "cpu"
    sent = torch.arange(12, dtype=torch.bfloat16, device=device).reshape(3, 4)
    host.send(sent, wait=False)  # from a GPU: a host copy, kept alive while in flight
    host.send(sent * 2, wait=False)
    got = peer.recv((3, 4), torch.bfloat16)
    assert got.device.type == "cpu" and torch.equal(got, sent.cpu())
    into = torch.zeros(2, 3, 4, dtype=torch.bfloat16, device=device)
    row = into[1]
    assert peer.recv_into(row) is row  # received in host memory, copied onto `device`
    host.flush()
    assert torch.equal(into[1], sent * 2) and not into[0].any()
    # A sum over the pair, each member's tensor on `device`.
    ones = [torch.ones(5, device=device), torch.full((5,), 2.0, device=device)]
    thread = threading.Thread(target=peer.all_reduce, args=(ones[1],))
    thread.start()
    host.all_reduce(ones[0])
    thread.join()
    for t in ones:
        assert t.device.type == device and torch.equal(t.cpu(), torch.full((5,), 3.0))


def test_a_group_sends_between_named_members_beside_its_all_reduces() -> None:
    """What a tensor-parallel group does with a remote prefill: rank 0 sends each other rank
    its slice, then all three all-reduce (a forward), in the same order on every member."""
    host = TensorLink.host("group-of-3", timeout_s=5.0, world=3)
    members: dict[int, TensorLink] = {0: host}
    got: dict[int, torch.Tensor] = {}

    def member(rank: int) -> None:
        link = members.setdefault(rank, TensorLink.join(host.address, 5.0, rank=rank))
        got[rank] = link.recv((2,), torch.float32, peer=0)
        link.all_reduce(ones := torch.full((3,), float(rank)))
        got[rank + 10] = ones

    threads = [threading.Thread(target=member, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    host.connect()
    host.send(torch.full((2,), 2.0), wait=False, peer=2)  # the later rank first
    host.send(torch.full((2,), 1.0), wait=False, peer=1)
    host.all_reduce(total := torch.zeros(3))
    host.flush()
    for t in threads:
        t.join()
    assert torch.equal(got[1], torch.ones(2)) and torch.equal(got[2], torch.full((2,), 2.0))
    for t in (total, got[11], got[12]):
        assert torch.equal(t, torch.full((3,), 3.0))
    with pytest.raises(ValueError, match="needs the peer named"):
        host.send(torch.zeros(1))
    with pytest.raises(ValueError, match="no peer 0"):
        host.recv((1,), torch.float32, peer=0)


def test_two_links_in_one_process_do_not_mix() -> None:
    a_host, a_peer = pair("link-a")
    b_host, b_peer = pair("link-b")
    a_host.send(torch.full((3,), 1.0), wait=False)
    b_host.send(torch.full((3,), 2.0), wait=False)
    assert torch.equal(b_peer.recv((3,), torch.float32), torch.full((3,), 2.0))
    assert torch.equal(a_peer.recv((3,), torch.float32), torch.full((3,), 1.0))


def test_a_peer_that_never_answers_is_a_timeout_not_a_hang() -> None:
    host, peer = pair("quiet", timeout_s=1.0)
    with pytest.raises(LinkError):
        host.recv((2,), torch.float32)  # the peer never sends
    assert not host.connected
    with pytest.raises(LinkError, match="not connected"):
        host.send(torch.zeros(2))
    del peer


def test_a_peer_that_fails_before_it_joins_fails_the_link_at_once() -> None:
    """The host's half of a link races the peer's Ray call: a call that fails (the worker died
    between the verifier's two calls) ends the wait at once, not at the link's timeout; a call
    that joins completes the link as `connect()` would."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        def dies(address: object) -> None:
            raise RuntimeError("gone before joining")

        @ray.remote
        def joins(address: object) -> float:
            link = TensorLink.join(address, timeout_s=30.0)  # type: ignore[arg-type]
            return float(link.recv((3,), torch.float32).sum())

        host = TensorLink.host("dies-first", timeout_s=60.0)
        start = time.perf_counter()
        with pytest.raises(LinkError, match="failed before it joined"):
            host.connect_racing(dies.remote(host.address))
        assert time.perf_counter() - start < 30  # the link's own timeout is 60 s
        assert not host.connected

        host = TensorLink.host("joins", timeout_s=60.0)
        joined = joins.remote(host.address)
        host.connect_racing(joined)
        assert host.connected
        host.send(torch.ones(3))
        assert ray.get(joined, timeout=30) == 3.0
    finally:
        ray.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [512, 7])
def test_a_prefill_over_a_link_delivers_what_it_computes(
    chunk: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker sends each layer's K/V during the forward (straight from its scratch cache),
    then the hidden states and the logits; the verifier's `receive` puts them back together:
    the same tensors as computing in one process, over one chunk or several (from a worker on
    a GPU, through host memory)."""
    import cluster.prefill as prefill
    from tests.factories import tiny_model

    monkeypatch.setattr(prefill, "PREFILL_CHUNK", chunk)
    model = tiny_model(seed=3, max_position_embeddings=128).to(device)
    prompt = torch.randint(3, 90, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = prefill.PrefillWorker(model, max_model_len=64, block_size=8).compute(prompt, (0, 1))
    host, peer = pair(f"prefill-{chunk}")
    worker = prefill.PrefillWorker(model, max_model_len=64, block_size=8)
    worker.links["verifier"] = peer
    timings: dict[str, dict] = {}
    thread = threading.Thread(
        # Layer 1 asked for twice (an EAGLE head of a shallow target fuses it twice): sent once.
        target=lambda: timings.setdefault("sent", worker.prefill(prompt, (0, 1, 1), "verifier"))
    )
    thread.start()
    plan = prefill.plan_for(model.config, len(prompt), (0, 1, 1), "float32")
    got = prefill.receive(host, plan, prompt)
    thread.join()
    assert torch.equal(got.kv, expected.kv.cpu())
    assert torch.equal(got.logits, expected.logits.cpu())
    assert got.hidden.keys() == {0, 1}
    for layer in (0, 1):
        assert torch.equal(got.hidden[layer], expected.hidden[layer].cpu())
    moved = sum(t.numel() * t.element_size() for t in (got.kv, *got.hidden.values(), got.logits))
    assert timings["sent"]["bytes"] == moved


def test_a_prompt_that_shares_the_held_prompts_start_computes_only_the_rest() -> None:
    """The scratch cache keeps the last prompt: the next one computes from the first token they
    do not share, and gets the same K/V, hidden states and logits as computing it afresh."""
    from cluster.prefill import PrefillWorker
    from tests.factories import tiny_model

    model = tiny_model(seed=3, max_position_embeddings=128)
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(3, 90, (13,), generator=gen).tolist()
    first, second = (system + torch.randint(3, 90, (9,), generator=gen).tolist() for _ in "ab")
    worker = PrefillWorker(model, max_model_len=64, block_size=8)
    worker.compute(first, (1,))
    assert worker.reused_tokens == 0
    got = worker.compute(second, (1,))
    assert worker.reused_tokens == 13
    fresh = PrefillWorker(model, max_model_len=64, block_size=8).compute(second, (1,))
    torch.testing.assert_close(got.kv, fresh.kv)
    torch.testing.assert_close(got.hidden[1], fresh.hidden[1])
    torch.testing.assert_close(got.logits, fresh.logits)
    worker.compute(second, (0, 1))  # layer 0's states are not held: nothing to reuse
    assert worker.reused_tokens == 0
    worker.compute(second, (0, 1))  # the same prompt again: all but its last token
    assert worker.reused_tokens == len(second) - 1


def test_a_worker_serving_two_verifiers_sends_each_its_own_prompts() -> None:
    """Each verifier group opens a link of its own to a shared worker, and each prompt goes
    over the link of the verifier that asked for it; a receive that finds another prompt's tag
    first raises before reading anything of the other prompt's size (a size mismatch would
    abort the process in gloo), and the link is dropped."""
    import cluster.prefill as prefill
    from tests.factories import tiny_model

    model = tiny_model(seed=3, max_position_embeddings=128)
    gen = torch.Generator().manual_seed(2)
    first, second = (torch.randint(3, 90, (n,), generator=gen).tolist() for n in (12, 20))
    fresh = prefill.PrefillWorker(model, max_model_len=64, block_size=8)
    expected = {"a": fresh.compute(first, ()).kv, "b": fresh.compute(second, ()).kv}
    worker = prefill.PrefillWorker(model, max_model_len=64, block_size=8)
    (a_host, a_peer), (b_host, b_peer) = pair("prefill-a", 30.0), pair("prefill-b", 30.0)
    worker.links.update({"a": a_peer, "b": b_peer})
    plan = partial(prefill.plan_for, model.config, layers=(), dtype="float32")
    sent = threading.Thread(
        target=lambda: (worker.prefill(first, (), "a"), worker.prefill(second, (), "b"))
    )
    sent.start()
    assert torch.equal(prefill.receive(a_host, plan(len(first)), first).kv, expected["a"])
    assert torch.equal(prefill.receive(b_host, plan(len(second)), second).kv, expected["b"])
    sent.join()

    def stray() -> None:  # a prompt given up on: the link is closed under its sends
        with contextlib.suppress(LinkError, RuntimeError):
            worker.prefill(first, (), "a")

    sending = threading.Thread(target=stray)
    sending.start()
    with pytest.raises(LinkError, match="another prompt"):
        prefill.receive(a_host, plan(len(second)), second)
    a_host.close()
    sending.join()
