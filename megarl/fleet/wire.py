"""The fleet's wire format (rollout.placement=fleet): typed messages as msgpack, never pickles.

A message is one or more ZeroMQ frames: the first is a msgpack map with a "type" and that type's
fields (`SCHEMAS`), the others (weights only) are raw tensor bytes, one frame per tensor, described
by the header's name / dtype / shape entries. `decode` checks everything a peer sent before anyone
reads it: the type, every field's presence and type, no field left over, the frame count and each
frame's byte length. A message that fails raises `WireError` with the reason; the receiver logs it
and drops the message (a peer never stops the run).

    server -> trainer   hello{token, server_id, engine}   (the first message; nothing is sent before
                                                            the token checks out)
                        ready{version}                    (weights of that version loaded)
                        result{step, version, request_ids, samples, tokens_per_s}
                        heartbeat{version}  bye{reason}
    trainer -> server   welcome{model_config, dtype, heartbeat_s}  refused{reason}
                        weights{version, tensors} + frames
                        request{step, version, request_ids, prompt_index, prompt_ids, seeds, sampling}
                        heartbeat{version}  bye{reason}
"""
from __future__ import annotations

import hmac
import math
from typing import Iterable

import msgpack
import torch

# the largest msgpack header or tensor frame a peer may send (64 MiB headers, 8 GiB tensors)
MAX_HEADER_BYTES = 64 << 20

# dtype names on the wire -> torch dtypes (nothing else is accepted)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
          "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# field types: a python type, or a one-element list [T] (a list of T), [[T]] (a list of lists of T)
Number = (int, float)
SCHEMAS: dict[str, dict[str, object]] = {
    "hello": {"token": str, "server_id": str, "engine": str},
    "welcome": {"model_config": dict, "dtype": str, "heartbeat_s": Number},
    "refused": {"reason": str},
    "weights": {"version": int, "tensors": [dict]},
    "ready": {"version": int},
    "request": {"step": int, "version": int, "request_ids": [int], "prompt_index": [int], "prompt_ids": [[int]],
                "seeds": [[int]], "sampling": dict},
    "result": {"step": int, "version": int, "request_ids": [int], "samples": [dict], "tokens_per_s": Number},
    "heartbeat": {"version": int},
    "bye": {"reason": str},
}
# the fields of the nested maps
SAMPLING = {"temperature": Number, "top_p": Number, "top_k": int, "max_new_tokens": int, "stop_token_ids": [int],
            "banned_token_ids": [int]}
SAMPLE = {"request_id": int, "sample_index": int, "token_ids": [int], "logprobs": [Number], "scaled_logprobs": [Number],
          "finish_reason": str}
TENSOR = {"name": str, "dtype": str, "shape": [int]}


class WireError(ValueError):
    """A malformed or unexpected message; str() is the reason, one line."""


def encode(kind: str, frames: list[bytes] | None = None, **fields) -> list[bytes]:
    """The frames of a message of type `kind` (checked against its schema before it leaves)."""
    header = {"type": kind, **fields}
    _check_fields(header, SCHEMAS[kind], kind)
    return [msgpack.packb(header, use_bin_type=True), *(frames or [])]


def decode(frames: list[bytes]) -> tuple[dict, list[bytes]]:
    """(header, tensor frames) of a received message, or WireError with the reason."""
    if not frames:
        raise WireError("empty message")
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frames[0])} bytes, over the {MAX_HEADER_BYTES} limit")
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several types for bad input: all are "not a message"
        raise WireError(f"header is not msgpack ({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise WireError(f"header is a {type(header).__name__}, not a map")
    kind = header.get("type")
    if kind not in SCHEMAS:
        raise WireError(f"unknown message type {kind!r}")
    _check_fields(header, SCHEMAS[kind], kind)
    rest = list(frames[1:])
    if kind == "weights":
        _check_weights(header, rest)
    elif rest:
        raise WireError(f"{kind} carries {len(rest)} extra frames")
    if kind == "request":
        _check_fields(header["sampling"], SAMPLING, "request.sampling")
        n = len(header["request_ids"])
        if not (len(header["prompt_index"]) == len(header["prompt_ids"]) == len(header["seeds"]) == n):
            raise WireError("request: request_ids, prompt_index, prompt_ids and seeds differ in length")
    if kind == "result":
        for sample in header["samples"]:
            _check_fields(sample, SAMPLE, "result.samples[]")
    return header, rest


def token_matches(shown: str, token: str) -> bool:
    """The run's token check, in constant time."""
    return hmac.compare_digest(shown.encode(), token.encode())


def tensor_frames(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[dict], list[bytes]]:
    """(the weights message's tensor entries, one raw-bytes frame per tensor: a copy of each, taken as
    `named` yields it)."""
    entries, frames = [], []
    for name, tensor in named:
        tensor = tensor.detach().to("cpu").contiguous()
        entries.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)})
        frames.append(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return entries, frames


def frame_tensors(header: dict, frames: list[bytes]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a decoded weights message (copies: the frames may be reused)."""
    out = []
    for entry, frame in zip(header["tensors"], frames):
        flat = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if len(frame) else torch.empty(0, dtype=torch.uint8)
        out.append((entry["name"], flat.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])))
    return out


def _check_weights(header: dict, frames: list[bytes]) -> None:
    entries = header["tensors"]
    if len(entries) != len(frames):
        raise WireError(f"weights: {len(entries)} tensor entries but {len(frames)} frames")
    for entry, frame in zip(entries, frames):
        _check_fields(entry, TENSOR, "weights.tensors[]")
        if entry["dtype"] not in DTYPES:
            raise WireError(f"weights: tensor {entry['name']!r} has dtype {entry['dtype']!r}, not one of {sorted(DTYPES)}")
        if any(d < 0 for d in entry["shape"]):
            raise WireError(f"weights: tensor {entry['name']!r} has a negative dimension")
        expected = math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize
        if len(frame) != expected:
            raise WireError(f"weights: tensor {entry['name']!r} is {len(frame)} bytes, its shape and dtype say {expected}")


def _check_fields(fields: dict, schema: dict, where: str) -> None:
    """Every field of `schema` present with its type, and nothing else (besides "type")."""
    if not isinstance(fields, dict):
        raise WireError(f"{where} is a {type(fields).__name__}, not a map")
    extra = set(fields) - set(schema) - {"type"}
    if extra:
        raise WireError(f"{where}: unknown field {sorted(extra)[0]!r}")
    for name, kind in schema.items():
        if name not in fields:
            raise WireError(f"{where}: missing field {name!r}")
        if not _is(fields[name], kind):
            raise WireError(f"{where}: field {name!r} has the wrong type ({type(fields[name]).__name__})")


def _is(value, kind) -> bool:
    if isinstance(kind, list):
        return isinstance(value, list) and all(_is(v, kind[0]) for v in value)
    if value is True or value is False:  # bool is an int to Python, never to the schema
        return kind is bool
    return isinstance(value, kind)
