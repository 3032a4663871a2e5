"""The default rollout engine: a Hugging Face `transformers` causal LM and a small decode loop.

`transformers.generate` samples every row from one global generator, so per-sample seeds need a
loop of our own: left-padded prompts, one forward with a DynamicCache, then one token per step
for every row, each row sampling with its own `torch.Generator` seeded by `make_sample_seed`.
A sample therefore depends only on (weights, prompt, seed), not on its batch (tested).
"""
from __future__ import annotations

import difflib
import inspect
import re
from collections import defaultdict
from typing import Iterable, Sequence

import torch

from megarl.models.moe_routing import HFRouteRecorder
from megarl.platform.cpu_compat import device_rewrite_paused
from megarl.rollout.base import RolloutRequest, RolloutResult, SampleSpec, SamplingParams, expand_samples
from megarl.rollout.sampling import process_logits, sample_rows

# Checkpoint-format expert weights -> transformers-5 fused in-memory parameters. Checkpoints (and
# vLLM / SGLang) name experts one by one; transformers 5 keeps `experts.gate_up_proj` [E, 2I, H]
# (gate rows first) and `experts.down_proj` [E, H, I] (conversion_mapping.py: "qwen2_moe",
# "mixtral"). Mixtral checkpoints also say `block_sparse_moe` where the module says `mlp`.
_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GATE_UP_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
_RENAMES = ((".block_sparse_moe.", ".mlp."),)


class HFRolloutEngine:
    """RolloutEngine over a transformers causal LM (CPU or one GPU; rollout tp 1)."""

    def __init__(self, model: torch.nn.Module, *, device: str | torch.device | None = None, max_batch_rows: int = 64):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.model = model.eval()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_batch_rows = max_batch_rows
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self._params = dict(model.named_parameters(remove_duplicate=False))
        # checkpoint tensors that are buffers: DeepSeek-V3 / GLM-4.5's score-correction bias, which
        # decides routes and must be the actor's (a frozen weight, synced like the others)
        self._params.update((n, b) for n, b in model.named_buffers() if n.endswith(".e_score_correction_bias"))
        self._released = False
        # MoE routing replay: set True to return each sample's experts (RolloutResult.routed_experts)
        self.record_routes = False
        # Asynchronous training (megarl.async_rollout): the policy version of the loaded weights,
        # recorded per token (RolloutResult.versions), and a hook run between decode steps that may
        # load newer weights mid-request (partial rollout: tokens, log-probs and KV cache are kept).
        self.version = 0
        self.between_tokens = None
        # transformers >= 5.2x names the KV cache argument `cache`; older releases `past_key_values`
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @classmethod
    def from_hf_dir(cls, hf_dir: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu", max_batch_rows: int = 64,
                    trust_remote_code: bool = False) -> "HFRolloutEngine":
        """Build the architecture from `hf_dir/config.json` with random weights; `load_weights` fills them.

        Token ids in, token ids out: the tokenizer is not needed here.
        """
        from transformers import AutoConfig  # deferred: transformers (seconds to import) loads only when this runs

        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
        return cls.from_config(config, dtype=dtype, device=device, max_batch_rows=max_batch_rows, trust_remote_code=trust_remote_code)

    @classmethod
    def from_config(cls, config, *, dtype: torch.dtype = torch.float32, device: str = "cpu", max_batch_rows: int = 64,
                    trust_remote_code: bool = False) -> "HFRolloutEngine":
        from transformers import AutoModelForCausalLM  # deferred: transformers (seconds to import) loads only when this runs

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(model, device=device, max_batch_rows=max_batch_rows)

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """len(requests) * n results, prompt-major; rows are decoded in batches of max_batch_rows."""
        if self._released:
            raise RuntimeError("HFRolloutEngine.generate() after release_memory(): call load_weights()/resume_memory() first")
        specs = expand_samples(requests, sampling)
        results: list[RolloutResult] = []
        # transformers and the decode loop name no CUDA device: on CPU they run without Megatron's
        # device-rewrite mode, which would route every torch call through Python (megarl.platform.cpu_compat).
        with device_rewrite_paused():
            for batch in self._batches(specs):
                results.extend(self._decode(batch, sampling))
        return results

    def _batches(self, specs: list[SampleSpec]) -> list[list[SampleSpec]]:
        """The rows decoded together: up to max_batch_rows; while recording routes, each prompt's
        samples alone. A near-tied router's choice follows the rounding of the batch's matmuls (its
        rows, its left padding), so routes recorded on whatever rows a rollout group was handed would
        depend on how the layout shares the prompts out (measured on the near-tied qwen3_moe of
        benchmarks/routing_replay.py: 19 of 784 token-layer routes differ between one batch of 32
        rows and two of 16), and routing replay would train each layout on other experts. A
        prompt's samples are never split over rollout groups (megarl.hybrid.dispatch)."""
        size = self.max_batch_rows
        if not self.record_routes:
            return [specs[start:start + size] for start in range(0, len(specs), size)]
        batches: list[list[SampleSpec]] = []
        for spec in specs:
            if batches and batches[-1][-1].request is spec.request and len(batches[-1]) < size:
                batches[-1].append(spec)
            else:
                batches.append([spec])
        return batches

    def _decode(self, specs: list[SampleSpec], sampling: SamplingParams) -> list[RolloutResult]:
        if not self.record_routes:
            return self._decode_rows(specs, sampling)
        with HFRouteRecorder(self.model) as recorder:
            results = self._decode_rows(specs, sampling)
        L = max(len(s.request.prompt_token_ids) for s in specs)
        for i, (spec, result) in enumerate(zip(specs, results)):
            result.routed_experts = recorder.routes(i, len(specs), len(spec.request.prompt_token_ids), L,
                                                    len(result.response_token_ids) - 1)
        return results

    def _decode_rows(self, specs: list[SampleSpec], sampling: SamplingParams) -> list[RolloutResult]:
        from transformers import DynamicCache  # deferred: transformers (seconds to import) loads only when this runs

        B, dev = len(specs), self.device
        prompts = [s.request.prompt_token_ids for s in specs]
        L = max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is at column L-1
            input_ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, L - len(p):] = 1
        input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
        # positions count real tokens only, so a padded row sees the positions it would see alone
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = [None if sampling.greedy else torch.Generator().manual_seed(s.seed) for s in specs]
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: DynamicCache(config=self.model.config)})
        next_pos = position_ids[:, -1:] + 1
        stop = set(sampling.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        scaled_lps: list[list[float]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        versions: list[list[int]] = [[] for _ in range(B)]
        logits_version = self.version  # the weights that computed out.logits
        for _ in range(sampling.max_new_tokens):
            processed, scaled = process_logits(out.logits[:, -1, :], sampling.temperature, sampling.top_k, sampling.top_p,
                                               sampling.banned_token_ids)
            live = [g if finish[i] is None else None for i, g in enumerate(generators)]
            tok = sample_rows(processed, live, sampling.greedy)
            tok_lp = processed.gather(-1, tok[:, None]).squeeze(-1).tolist()
            tok_slp = scaled.gather(-1, tok[:, None]).squeeze(-1).tolist()
            tok_list = tok.tolist()
            for i in range(B):
                if finish[i] is not None:
                    continue
                tokens[i].append(tok_list[i])
                lps[i].append(tok_lp[i])
                scaled_lps[i].append(tok_slp[i])
                versions[i].append(logits_version)
                if tok_list[i] in stop:
                    finish[i] = "stop"
                elif len(tokens[i]) == sampling.max_new_tokens:
                    finish[i] = "length"
            if all(f is not None for f in finish):
                break
            # finished rows keep decoding (their tokens are discarded): rows never interact
            if self.between_tokens is not None:  # may load newer weights: the next logits are theirs
                self.between_tokens()
                logits_version = self.version
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=-1)
            out = self.model(input_ids=tok[:, None], attention_mask=attention_mask, position_ids=next_pos,
                             use_cache=True, **{self._cache_kw: out[self._cache_kw]})
            next_pos = next_pos + 1
        return [
            RolloutResult(s.request.prompt_index, s.sample_index, tokens[i], lps[i], finish[i] or "length", scaled_lps[i],
                          versions=versions[i])
            for i, s in enumerate(specs)
        ]

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Copy a stream of HF-checkpoint-named full tensors into the model; return the names loaded.

        Names are checkpoint names (per-expert MoE weights, tied `lm_head.weight` optional). The
        whole stream is consumed before raising on unknown names or wrong shapes, because the
        producer is a collective over all ranks. strict: every parameter must have been written.
        """
        self._wake_weights()
        written: dict[str, int] = defaultdict(int)  # parameter name -> elements written
        problems: list[str] = []
        loaded: set[str] = set()
        for name, tensor in weights:
            target, key, problem = self._resolve(name, tensor)
            if problem:
                problems.append(problem)
                continue
            target.copy_(tensor)
            written[key] += tensor.numel()
            loaded.add(name)
        if strict:
            by_storage: dict[int, list[str]] = defaultdict(list)  # tied weights share one storage
            for pname, p in self._params.items():
                by_storage[p.data_ptr()].append(pname)
            for names in by_storage.values():
                numel = self._params[names[0]].numel()
                if sum(written.get(n, 0) for n in names) < numel:
                    problems.append(f"parameter {names[0]} was not (fully) written by the weight stream")
        if problems:
            raise ValueError("HFRolloutEngine.load_weights: " + "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))
        return loaded

    def _resolve(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor | None, str, str | None]:
        """Map a checkpoint name to (destination view, parameter name, problem or None)."""
        candidates = [name] + [name.replace(a, b) for a, b in _RENAMES if a in name]
        for cand in candidates:
            if cand in self._params:
                p = self._params[cand]
                return self._check(p, cand, name, tensor)
            m = _EXPERT_RE.match(cand)
            if m is None:
                continue
            e, proj = int(m["expert"]), m["proj"]
            fused = m["prefix"] + (".down_proj" if proj in ("down_proj", "w2") else ".gate_up_proj")
            if fused not in self._params:
                continue
            p = self._params[fused]
            if e >= p.shape[0]:
                return None, fused, f"{name}: expert {e} out of range for {fused} with {p.shape[0]} experts"
            view = p[e]
            if proj in _GATE_UP_PART:
                half = view.shape[0] // 2
                view = view[:half] if _GATE_UP_PART[proj] == 0 else view[half:]
            return self._check(view, fused, name, tensor)
        near = difflib.get_close_matches(name, list(self._params), n=1)
        return None, name, f"unknown weight {name!r}" + (f" (nearest: {near[0]!r})" if near else "")

    @staticmethod
    def _check(view: torch.Tensor, key: str, name: str, tensor: torch.Tensor):
        if tuple(view.shape) != tuple(tensor.shape):
            return None, key, f"{name}: shape {tuple(tensor.shape)} does not match {key} slot {tuple(view.shape)}"
        return view, key, None

    # ---------------------------------------------------------------- memory
    def release_memory(self) -> None:
        """Free GPU memory for training. On CPU a no-op: offloading would copy to the same RAM."""
        if self.device.type == "cuda" and not self._released:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._released = True

    def _wake_weights(self) -> None:
        if self.device.type == "cuda" and self._released:
            self.model.to(self.device)
        self._released = False

    def resume_memory(self) -> None:
        """Bring weights back to the device (the KV cache is allocated per generate call)."""
        self._wake_weights()

    def close(self) -> None:
        self.model = None
        self._params = {}
