"""The fleet's wire format, the endpoint's door and its resubmission, the fleet's config rules
(rollout.placement=fleet, issue 41), in one process with fake servers."""
from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from megarl.fleet import link
from megarl.fleet.endpoint import FleetEndpoint, WaitStopped
from megarl.fleet.wire import WireError, decode, encode, token_matches

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 4, "stop_token_ids": [2], "banned_token_ids": []}


def test_messages_round_trip():
    frames = encode("request", step=3, version=2, request_ids=[7, 8], prompt_index=[0, 1], prompt_ids=[[5, 6], [7]],
                    seeds=[[11, 12], [13, 14]], sampling=SAMPLING)
    assert decode(frames) == {"type": "request", "step": 3, "version": 2, "request_ids": [7, 8], "prompt_index": [0, 1],
                              "prompt_ids": [[5, 6], [7]], "seeds": [[11, 12], [13, 14]], "sampling": SAMPLING}


def test_weights_round_trip_every_dtype_bitwise():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.arange(6).reshape(2, 3)),
             ("empty", torch.zeros(0, 2))]
    entries, flat = link.flatten(named)
    header = decode(encode("weights", version=1, tensors=entries, bytes=flat.numel()))
    assert header["bytes"] == link.nbytes(entries) == 3 * 4 * 4 + 16 + 6 * 8  # bf16's 10 bytes padded to 16
    back = link.unflatten(header["tensors"], flat.clone())
    assert [n for n, _ in back] == ["a", "b", "c", "empty"]
    for (_, x), (_, y) in zip(named, back):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _header(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("frames, reason", [
    ([], "empty message"),
    ([b"\xc1not msgpack"], "header is not msgpack"),
    ([_header(type="pickle", data=b"x")], "unknown message type 'pickle'"),
    ([msgpack.packb([1, 2])], "header is a list, not a map"),
    ([_header(type="hello", token="t", server_id="s")], "hello: missing field 'engine'"),
    ([_header(type="hello", token="t", server_id="s", engine="hf", tp=1, extra=1)], "hello: unknown field 'extra'"),
    ([_header(type="heartbeat", version="1")], "heartbeat: field 'version' has the wrong type (str)"),
    ([_header(type="heartbeat", version=True)], "heartbeat: field 'version' has the wrong type (bool)"),
    ([_header(type="heartbeat", version=1), b"x"], "heartbeat carries 1 extra frames"),
    ([_header(type="weights", version=1, tensors=[{"name": "w", "dtype": "float32", "shape": [2]}], bytes=3)],
     "weights: 3 bytes, but its tensors' shapes and dtypes say 8 (each at a multiple of 8)"),
    ([_header(type="weights", version=1, tensors=[{"name": "w", "dtype": "object", "shape": [1]}], bytes=1)],
     "weights: tensor 'w' has dtype 'object'"),
    ([_header(type="weights", version=1, tensors=[], bytes=0), b"x"], "weights carries 1 extra frames"),
    ([_header(type="welcome", model_config={}, dtype="float32", max_model_len=None, heartbeat_s=1.0, transfer={"port": 1}, partial_rollout=False)],
     "welcome.transfer: missing field 'backend'"),
    ([_header(type="welcome", model_config={}, dtype="float32", max_model_len="64", heartbeat_s=1.0, transfer={}, partial_rollout=False)],
     "welcome: field 'max_model_len' has the wrong type (str)"),
    ([_header(type="request", step=1, version=1, request_ids=[1], prompt_index=[0], prompt_ids=[[1]], seeds=[],
              sampling=SAMPLING)], "request: request_ids, prompt_index, prompt_ids and seeds differ in length"),
    ([_header(type="result", step=1, version=1, request_ids=[1], samples=[{"request_id": 1}], tokens_per_s=1.0)],
     "result.samples[]: missing field 'sample_index'"),
])
def test_malformed_messages_name_their_reason(frames, reason):
    with pytest.raises(WireError) as err:
        decode(frames)
    assert reason in str(err.value)


def test_token_check():
    assert token_matches("abc", "abc") and not token_matches("abd", "abc") and not token_matches("", "abc")


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recv(sock, timeout_s: float = 5.0, skip_heartbeats: bool = False):
    """The next message's header (None within timeout_s); the endpoint's heartbeats skipped if asked."""
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
        header = decode(sock.recv_multipart())
        if not (skip_heartbeats and header["type"] == "heartbeat"):
            return header
    return None


def test_endpoint_refuses_a_wrong_token_and_drops_malformed_messages():
    """A server with the wrong token gets the refusal and nothing else; malformed messages are
    dropped with one log line each; a server with the token gets the welcome and the weights."""
    lines: list[str] = []
    port = _port()
    endpoint = FleetEndpoint("127.0.0.1", port, "s3cret", 30.0, {"model_type": "llama"}, "float32", log=lines.append)
    endpoint.publish(1, [("w", torch.ones(2))])
    context = zmq.Context.instance()
    socks = []
    try:
        intruder = context.socket(zmq.DEALER)
        socks.append(intruder)
        intruder.connect(f"tcp://127.0.0.1:{port}")
        intruder.send_multipart(encode("hello", token="guess", server_id="intruder", engine="hf", tp=1))
        assert _recv(intruder) == {"type": "refused", "reason": "wrong token: use the run's rollout.fleet.token_file"}
        intruder.send_multipart([b"\x93garbage"])  # malformed: dropped with a line
        intruder.send_multipart(encode("heartbeat", version=1))  # well-formed but not joined: dropped
        assert _recv(intruder, 1.0) is None  # nothing else comes back: no config, no weights
        server = context.socket(zmq.DEALER)
        socks.append(server)
        server.connect(f"tcp://127.0.0.1:{port}")
        server.send_multipart(encode("hello", token="s3cret", server_id="good", engine="hf", tp=1))
        welcome = _recv(server)
        assert welcome["type"] == "welcome" and welcome["model_config"] == {"model_type": "llama"}
        # the server built its engine: it joins the link offered, and the current weights come over it
        server.send_multipart(encode("link", prefix=welcome["transfer"]["prefix"]))
        group = link.join("127.0.0.1", welcome["transfer"])
        header = _recv(server, skip_heartbeats=True)
        assert header["type"] == "weights" and header["version"] == 1
        flat = link.receive(group, header["bytes"], 10.0)
        assert torch.equal(link.unflatten(header["tensors"], flat)[0][1], torch.ones(2))
        deadline = time.monotonic() + 5
        while len([line for line in lines if "dropped" in line]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close(0)
        endpoint.close()
    assert "megarl fleet: refused server 'intruder': wrong token" in lines
    assert any("dropped a malformed message from a peer that has not joined: header is not msgpack" in line for line in lines)
    assert any("dropped a heartbeat message from a peer that has not joined" in line for line in lines)
    stats = endpoint.stats
    assert (stats.refused_total, stats.joined_total, stats.dropped_total) == (1, 1, 2)


def test_a_server_of_another_engine_is_refused_and_one_of_the_runs_is_told_the_sequence_length():
    """The run's servers all run rollout.engine at rollout.tp (hf and vLLM sample differently from one
    seed): a server of another engine or size gets a refusal naming how to start one; one of the run's
    engine gets the welcome, with max_model_len (vLLM sizes its KV cache by it)."""
    lines: list[str] = []
    port = _port()
    endpoint = FleetEndpoint("127.0.0.1", port, "tok", 30.0, {"model_type": "llama"}, "float32", log=lines.append,
                             engine="vllm", tp=2, max_model_len=40)
    context = zmq.Context.instance()
    socks = [context.socket(zmq.DEALER) for _ in range(3)]
    try:
        for sock in socks:
            sock.connect(f"tcp://127.0.0.1:{port}")
        socks[0].send_multipart(encode("hello", token="tok", server_id="hf-one", engine="hf", tp=1))
        assert _recv(socks[0]) == {"type": "refused", "reason": "engine 'hf': this run's servers run rollout.engine=vllm: "
                                                                "start them with --engine vllm"}
        # vLLM at another tensor-parallel size sums in another order: a resubmitted request could change
        socks[1].send_multipart(encode("hello", token="tok", server_id="vllm-one", engine="vllm", tp=1))
        assert _recv(socks[1]) == {"type": "refused", "reason": (
            f"1 ranks: this run's servers run rollout.tp=2: start one with `torchrun --nproc_per_node 2 -m "
            f"megarl.rollout.serve --trainer 127.0.0.1:{port} --token-file <rollout.fleet.token_file> --engine vllm`")}
        socks[2].send_multipart(encode("hello", token="tok", server_id="vllm-two", engine="vllm", tp=2))
        welcome = _recv(socks[2], skip_heartbeats=True)
        assert welcome["type"] == "welcome" and welcome["max_model_len"] == 40
    finally:
        for sock in socks:
            sock.close(0)
        endpoint.close(farewell=False)
    assert "megarl fleet: refused server 'hf-one': engine 'hf', but this run's rollout.engine is vllm" in lines
    assert "megarl fleet: refused server 'vllm-one': 1 ranks, but this run's rollout.tp is 2" in lines
    assert (endpoint.stats.refused_total, endpoint.stats.joined_total) == (2, 1)


@pytest.mark.parametrize("overrides, world_size, message", [
    (["rollout.engine=sglang"], 1, "rollout.placement=fleet runs servers with rollout.engine=hf or vllm so far, got sglang"),
    (["rollout.tp=2"], 1, "rollout.placement=fleet runs servers of rollout.tp > 1 with rollout.engine=vllm (torchrun "
                          "--nproc_per_node 2 -m megarl.rollout.serve), got rollout.engine=hf"),
    (["async.max_staleness=1", "async.partial_rollout=true", "rollout.engine=vllm"], 1,
     "async.partial_rollout over a fleet runs rollout.engine=hf servers, got vllm"),
    (["async.partial_rollout=true"], 1, "set async.max_staleness >= 1 or async.partial_rollout=false"),
    (["async.max_staleness=1", "algorithm.filter_groups.enable=true", "algorithm.adv_estimator=grpo"], 1,
     "set async.max_staleness=0 or algorithm.filter_groups.enable=false"),
    (["rollout.num_ranks=1"], 1, "rollout.num_ranks = 1 applies to rollout.placement=separate only"),
    (["algorithm.adv_estimator=remax", "async.max_staleness=1"], 1,
     "algorithm.adv_estimator=remax takes its greedy baseline from the current weights"),
    (["actor.routing_replay=true"], 1, "rollout.placement=fleet does not run actor.routing_replay yet"),
    (["rollout.fleet.host=10.0.0.0/24"], 1, "is not an interface address or name"),
])
def test_fleet_config_refusals(overrides, world_size, message):
    """What the fleet does not run yet is one line naming the key and the way out."""
    from megarl.config import load_config
    from megarl.config.schema import ConfigError
    from megarl.config.validation import validate

    with pytest.raises(ConfigError) as err:  # load_config checks values; validate with a world size the layout
        validate(load_config("configs/tiny_cpu.yaml", ["rollout.placement=fleet", *overrides]), world_size)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fleet_vllm_servers_need_no_vllm_in_the_training_job():
    """rollout.engine=vllm under fleet names the servers' engine; the training job builds none, so the
    config check does not ask for vllm here (this environment has none) nor sizes a colocated engine."""
    from megarl.capacity.memory_check import check_colocated_memory
    from megarl.config import load_config
    from megarl.config.inputs import check_rollout_engine
    from megarl.config.validation import validate

    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.placement=fleet", "rollout.engine=vllm"])
    validate(cfg, 1)
    check_rollout_engine(cfg)
    # servers of rollout.tp = 2 are worlds of their own: a training world of 1 need not be a multiple
    validate(load_config("configs/tiny_cpu.yaml", ["rollout.placement=fleet", "rollout.engine=vllm", "rollout.tp=2"]), 1)
    assert check_colocated_memory(cfg, 1, device_bytes=1.0)[1] is None  # 1 byte of GPU: nothing to fit beside training


def test_fleet_config_defaults_bind_loopback():
    from megarl.config import load_config
    from megarl.config.validation import validate

    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.placement=fleet"])
    validate(cfg, 1)
    assert (cfg.rollout.fleet.host, cfg.rollout.fleet.min_servers) == ("127.0.0.1", 1)


def _answer(header: dict, drop_one: bool = False) -> list[bytes]:
    """A fake server's result for a request: one token per sample, its seed mod 7."""
    samples = [{"request_id": rid, "sample_index": j, "token_ids": [seed % 7], "logprobs": [-0.5], "scaled_logprobs": [-0.4],
                "finish_reason": "length", "versions": [header["version"]]}
               for rid, seeds in zip(header["request_ids"], header["seeds"]) for j, seed in enumerate(seeds)]
    return encode("result", step=header["step"], version=header["version"], request_ids=header["request_ids"],
                  samples=samples[:-1] if drop_one else samples, tokens_per_s=100.0)


def test_endpoint_resubmits_a_lost_servers_requests_and_drops_its_late_answer():
    """Two fake servers; s2 falls silent holding its chunk: after heartbeat_s its requests go to s1
    with the same seeds, and s2's late answer is dropped. A result missing a sample is dropped and
    its requests handed out again."""
    import threading

    lines: list[str] = []
    port = _port()
    endpoint = FleetEndpoint("127.0.0.1", port, "tok", 1.0, {}, "float32", log=lines.append)
    endpoint.publish(1, [("w", torch.zeros(1))])
    context = zmq.Context.instance()
    s1, s2 = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    out: dict = {}
    try:
        for name, sock in (("s1", s1), ("s2", s2)):
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(encode("hello", token="tok", server_id=name, engine="hf", tp=1))
            assert _recv(sock, skip_heartbeats=True)["type"] == "welcome"
            sock.send_multipart(encode("ready", version=1))  # no link: the weights do not matter here
        requests = [{"prompt_index": i, "prompt_ids": [1, i], "seeds": [10 * i, 10 * i + 1]} for i in range(4)]
        runner = threading.Thread(target=lambda: out.update(endpoint.run(1, requests, SAMPLING, min_servers=2)))
        runner.start()
        first1, first2 = _recv(s1, skip_heartbeats=True), _recv(s2, skip_heartbeats=True)
        assert first1["type"] == first2["type"] == "request"
        assert first1["prompt_index"] == [0, 1] and first2["prompt_index"] == [2, 3]
        s1.send_multipart(_answer(first1))
        chunks, malformed_sent = [], False
        deadline = time.monotonic() + 20
        while runner.is_alive() and time.monotonic() < deadline:  # s1 beats on; s2 stays silent
            s1.send_multipart(encode("heartbeat", version=1))
            if s1.poll(200):
                header = decode(s1.recv_multipart())
                if header["type"] == "request":
                    chunks.append(header)
                    s1.send_multipart(_answer(header, drop_one=not malformed_sent))
                    malformed_sent = True
        s2.send_multipart(_answer(first2))  # too late: its requests were answered by s1
        runner.join(timeout=5)
        time.sleep(0.3)
    finally:
        s1.close(0)
        s2.close(0)
        endpoint.close()
    assert not runner.is_alive() and sorted(out) == [0, 1, 2, 3]
    assert [c["prompt_index"] for c in chunks] == [[2, 3], [2, 3]]  # resubmitted, then again after the bad result
    assert chunks[0]["seeds"] == first2["seeds"]  # the same seeds wherever they run
    assert {out[i].server_id for i in range(4)} == {"s1"}
    assert [s["token_ids"] for s in out[2].samples] == [[20 % 7], [21 % 7]]
    assert any(line.startswith("megarl fleet: lost server s2") for line in lines)
    assert any("does not have its 2 samples" in line for line in lines)
    assert any(line.startswith("megarl fleet: dropped a result message from a peer that has not joined") for line in lines)
    assert (endpoint.stats.lost_total, endpoint.stats.resubmitted_total, endpoint.stats.servers) == (1, 2, 1)


def test_jobs_submitted_ahead_go_out_and_are_resubmitted_while_nobody_collects():
    """async.max_staleness: a job submitted before its servers are there is handed out by the socket's
    thread as soon as min_servers hold its weights, with no collect running; a lost server's share goes
    to a server that has newer weights meanwhile, whose answer (fresher) is kept, while an answer
    older than the job's weights is dropped."""
    lines: list[str] = []
    port = _port()
    endpoint = FleetEndpoint("127.0.0.1", port, "tok", 1.0, {}, "float32", log=lines.append)
    endpoint.publish(1, [("w", torch.zeros(1))])
    context = zmq.Context.instance()
    s1, s2 = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    requests = [{"prompt_index": i, "prompt_ids": [1, i], "seeds": [10 * i, 10 * i + 1]} for i in range(4)]
    try:
        job = endpoint.submit(2, requests, SAMPLING, min_servers=2)  # nobody there yet
        for name, sock in (("s1", s1), ("s2", s2)):
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(encode("hello", token="tok", server_id=name, engine="hf", tp=1))
            assert _recv(sock, skip_heartbeats=True)["type"] == "welcome"
            sock.send_multipart(encode("ready", version=1))
        first1, first2 = _recv(s1, skip_heartbeats=True), _recv(s2, skip_heartbeats=True)
        assert (first1["type"], first1["version"], first1["prompt_index"]) == ("request", 1, [0, 1])
        assert first2["prompt_index"] == [2, 3]
        endpoint.publish(2, [("w", torch.ones(1))])  # the trainer's next step; s1 takes it, s2 falls silent
        s1.send_multipart(encode("ready", version=2))
        old = _answer(first1)
        old[0] = encode("result", step=2, version=0, request_ids=first1["request_ids"], samples=[], tokens_per_s=1.0)[0]
        s1.send_multipart(old)  # older than the job's weights: dropped, and its requests stay with s1
        s1.send_multipart(_answer(first1))
        resubmitted, deadline = None, time.monotonic() + 20
        while resubmitted is None and time.monotonic() < deadline:  # s1 beats on until s2's share comes
            s1.send_multipart(encode("heartbeat", version=2))
            if s1.poll(200):
                header = decode(s1.recv_multipart())
                resubmitted = header if header["type"] == "request" else None
        assert resubmitted["prompt_index"] == [2, 3] and resubmitted["seeds"] == first2["seeds"]
        assert resubmitted["version"] == 1  # the oldest weights it may be generated with
        fresher = decode(_answer(resubmitted))
        s1.send_multipart(encode("result", **{**{k: v for k, v in fresher.items() if k != "type"}, "version": 2}))
        out = endpoint.collect(job)
    finally:
        s1.close(0)
        s2.close(0)
        endpoint.close()
    assert [out[i].version for i in range(4)] == [1, 1, 2, 2] and {out[i].server_id for i in range(4)} == {"s1"}
    assert [s["token_ids"] for s in out[3].samples] == [[30 % 7], [31 % 7]]
    assert any(line.startswith("megarl fleet: dropped a result of server s1 (weights version 0") for line in lines)
    assert (endpoint.stats.lost_total, endpoint.stats.resubmitted_total) == (1, 2)


def test_a_wait_for_servers_ends_when_stop_says_so():
    """With fewer than min_servers servers, run waits (saying so each heartbeat_s) until stop() is
    true, then raises WaitStopped naming the step and the servers it had; the endpoint still closes."""
    lines: list[str] = []
    endpoint = FleetEndpoint("127.0.0.1", _port(), "s3cret", 0.2, {"model_type": "llama"}, "float32", log=lines.append)
    try:
        endpoint.publish(3, [("w", torch.ones(2))])
        asked = []
        with pytest.raises(WaitStopped, match="step 3 waited for rollout servers: 0 of 2 held weights version 3"):
            endpoint.run(3, [{"prompt_index": 0, "prompt_ids": [1, 2], "seeds": [7]}],
                         {"temperature": 1.0}, 2, stop=lambda: asked.append(1) or len(asked) > 5)
        assert len(asked) == 6  # asked at each look while it waited, stopped at the first yes
    finally:
        endpoint.close(farewell=False)  # writes the log's last lines
    assert any("step 3: waiting for rollout servers: 0 of 2" in line for line in lines)


def test_a_server_whose_link_breaks_is_lost_and_a_new_one_gets_a_new_link():
    """Each joined server has a weight link of its own: a publish reaches every linked server over
    its link; a server whose link breaks (its group gone: a dead process) is lost at the next
    publish, and the other server, linked apart, still gets every version."""
    lines: list[str] = []
    port = _port()
    endpoint = FleetEndpoint("127.0.0.1", port, "tok", 30.0, {}, "float32", log=lines.append)
    context = zmq.Context.instance()
    socks, groups, offers = {}, {}, {}
    try:
        endpoint.publish(1, [("w", torch.full((3,), 1.0))])
        for name in ("s1", "s2"):
            sock = socks[name] = context.socket(zmq.DEALER)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(encode("hello", token="tok", server_id=name, engine="hf", tp=1))
            offers[name] = _recv(sock, skip_heartbeats=True)["transfer"]
            sock.send_multipart(encode("link", prefix=offers[name]["prefix"]))
            groups[name] = link.join("127.0.0.1", offers[name])
            header = _recv(sock, skip_heartbeats=True)
            assert header["version"] == 1
            assert torch.equal(link.unflatten(header["tensors"], link.receive(groups[name], header["bytes"], 10.0))[0][1],
                               torch.full((3,), 1.0))
        assert offers["s1"]["prefix"] != offers["s2"]["prefix"]  # a link each
        del groups["s2"]  # s2's process is gone: its end of the link closes
        import threading

        got = {}

        def s1_receives():
            header = _recv(socks["s1"], skip_heartbeats=True)
            got[header["version"]] = link.unflatten(header["tensors"], link.receive(groups["s1"], header["bytes"], 10.0))
        receiver = threading.Thread(target=s1_receives)
        receiver.start()
        endpoint.publish(2, [("w", torch.full((3,), 2.0))])
        receiver.join(timeout=30)
        assert torch.equal(got[2][0][1], torch.full((3,), 2.0))
        deadline = time.monotonic() + 30  # publish returned once the sends were issued: a thread awaits them
        while endpoint.stats.lost_total < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint.stats.lost_total == 1
    finally:
        for sock in socks.values():
            sock.close(0)
        endpoint.close(farewell=False)
    assert any(line.startswith("megarl fleet: lost server s2 (its weight link broke:") for line in lines), lines


def test_a_blocked_log_never_holds_up_the_endpoint():
    """The endpoint's log lines are written by a thread of their own: with every write blocked (a log
    file under the kernel's dirty-page throttling, a full pipe), a server still joins, gets its
    welcome and the trainer's heartbeats, and is not lost; the lines are written, in order, once
    the writes go through."""
    import threading

    release, written = threading.Event(), []

    def blocked(line: str) -> None:
        release.wait()
        written.append(line)

    endpoint = FleetEndpoint("127.0.0.1", port := _port(), "tok", 0.6, {}, "float32", log=blocked)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(encode("hello", token="tok", server_id="s", engine="hf", tp=1))
        assert _recv(sock)["type"] == "welcome"  # the join's log line is still waiting to be written
        beats, deadline = 0, time.monotonic() + 3.0
        while time.monotonic() < deadline:
            sock.send_multipart(encode("heartbeat", version=0))
            header = _recv(sock, 0.2)
            beats += header is not None and header["type"] == "heartbeat"
        assert beats >= 2 and endpoint.stats.lost_total == 0 and written == []
    finally:
        release.set()
        sock.close(0)
        endpoint.close(farewell=False)
    assert written[0] == "megarl fleet: server s joined; 1 joined"


def test_a_joining_server_has_the_link_timeout_not_heartbeat_s():
    """A server welcomed but holding no weights yet (building its engine, which can hold its
    interpreter for seconds) is not lost after heartbeat_s of silence; once it holds weights, it is."""
    lines: list[str] = []
    endpoint = FleetEndpoint("127.0.0.1", port := _port(), "tok", 0.3, {}, "float32", log=lines.append)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(encode("hello", token="tok", server_id="slow", engine="hf", tp=1))
        assert _recv(sock)["type"] == "welcome"
        time.sleep(1.5)  # silent for 5 heartbeat_s while "building its engine"
        assert endpoint.stats.lost_total == 0 and endpoint.link_timeout_s >= 60
        sock.send_multipart(encode("ready", version=1))  # holds weights now: heartbeat_s applies
        deadline = time.monotonic() + 10
        while endpoint.stats.lost_total == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint.stats.lost_total == 1
    finally:
        sock.close(0)
        endpoint.close(farewell=False)
    assert any(line.startswith("megarl fleet: lost server slow (silent for") for line in lines)

