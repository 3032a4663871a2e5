"""The fleet's wire format (rollout.placement=fleet): typed messages as msgpack, never pickles.

A message is one ZeroMQ frame: a msgpack map with a "type" and that type's fields (`SCHEMAS`). A
weights message describes the tensors (name / dtype / shape entries, and their total bytes, each
tensor starting at a multiple of ALIGN); the bytes themselves follow over the server's weight link (megarl/fleet/link.py), not over ZeroMQ.
`decode` checks everything a peer sent before anyone reads it: the type, every field's presence and
type, no field left over, no extra frame, and a weights message's byte count against its entries.
A message that fails raises `WireError` with the reason; the receiver logs it and drops the message
(a peer never stops the run).

    server -> trainer   hello{token, server_id, engine, tp}   (the first message; nothing is sent before
                                                            the token checks out)
                        link{prefix}                      (its engine is built: it joins its weight link)
                        ready{version}                    (weights of that version loaded)
                        result{step, version, request_ids, samples, tokens_per_s}
                                                          (a sample's versions: each token's weights)
                        heartbeat{version}  bye{reason}
    trainer -> server   welcome{model_config, dtype, max_model_len, heartbeat_s, transfer, partial_rollout}
                        refused{reason}                   (transfer: where its weight link meets;
                                                           max_model_len: prompt + response tokens, or nil;
                                                           partial_rollout: load new weights between tokens)
                        weights{version, tensors, bytes}  (the bytes then come over the link)
                        request{step, version, request_ids, prompt_index, prompt_ids, seeds, sampling}
                        heartbeat{version}  bye{reason}
"""
from __future__ import annotations

import hmac
import math

import msgpack
import torch

# the largest msgpack message a peer may send
MAX_HEADER_BYTES = 64 << 20

# dtype names on the wire -> torch dtypes (nothing else is accepted)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
          "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# field types: a python type, or a one-element list [T] (a list of T), [[T]] (a list of lists of T)
Number = (int, float)
OptionalInt = (int, type(None))
SCHEMAS: dict[str, dict[str, object]] = {
    "hello": {"token": str, "server_id": str, "engine": str, "tp": int},
    "welcome": {"model_config": dict, "dtype": str, "max_model_len": OptionalInt, "heartbeat_s": Number, "transfer": dict,
                "partial_rollout": bool},
    "refused": {"reason": str},
    "weights": {"version": int, "tensors": [dict], "bytes": int},
    "link": {"prefix": str},
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
          "finish_reason": str, "versions": [int]}
TENSOR = {"name": str, "dtype": str, "shape": [int]}
TRANSFER = {"backend": str, "port": int, "prefix": str, "timeout_s": Number}


# each tensor's bytes start at a multiple of this in a weights buffer, so that every dtype can view
# them in place
ALIGN = 8


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class WireError(ValueError):
    """A malformed or unexpected message; str() is the reason, one line."""


def encode(kind: str, **fields) -> list[bytes]:
    """The frames of a message of type `kind` (checked against its schema before it leaves)."""
    header = {"type": kind, **fields}
    _check_fields(header, SCHEMAS[kind], kind)
    return [msgpack.packb(header, use_bin_type=True)]


def decode(frames: list[bytes]) -> dict:
    """The header of a received message, or WireError with the reason."""
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
    if len(frames) > 1:
        raise WireError(f"{kind} carries {len(frames) - 1} extra frames")
    if kind == "weights":
        _check_weights(header)
    if kind == "welcome":
        _check_fields(header["transfer"], TRANSFER, "welcome.transfer")
    if kind == "request":
        _check_fields(header["sampling"], SAMPLING, "request.sampling")
        n = len(header["request_ids"])
        if not (len(header["prompt_index"]) == len(header["prompt_ids"]) == len(header["seeds"]) == n):
            raise WireError("request: request_ids, prompt_index, prompt_ids and seeds differ in length")
    if kind == "result":
        for sample in header["samples"]:
            _check_fields(sample, SAMPLE, "result.samples[]")
    return header


def token_matches(shown: str, token: str) -> bool:
    """The run's token check, in constant time."""
    return hmac.compare_digest(shown.encode(), token.encode())


def _check_weights(header: dict) -> None:
    total = 0
    for entry in header["tensors"]:
        _check_fields(entry, TENSOR, "weights.tensors[]")
        if entry["dtype"] not in DTYPES:
            raise WireError(f"weights: tensor {entry['name']!r} has dtype {entry['dtype']!r}, not one of {sorted(DTYPES)}")
        if any(d < 0 for d in entry["shape"]):
            raise WireError(f"weights: tensor {entry['name']!r} has a negative dimension")
        total += aligned(math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize)
    if header["bytes"] != total:
        raise WireError(f"weights: {header['bytes']} bytes, but its tensors' shapes and dtypes say {total} "
                        f"(each at a multiple of {ALIGN})")


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
