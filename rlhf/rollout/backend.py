"""What the RL loop asks of its rollout engines: the one protocol between the trainer and whatever generates.

:class:`rlhf.rollout.vllm.engines.RolloutEngines` (vLLM engine actors) implements it. The loop
(:class:`rlhf.trainers.online.steps.RLTrainer`, the bounded-staleness schedule, multi-turn episodes) calls these methods
and nothing else, never a vLLM RPC by name. So another engine (SGLang, a remote server) is a class with these methods
and the weight-sync methods its senders call (``rlhf.rollout.weights.senders``).

The weights reach a backend from the policy's ranks (``connect_weight_sync`` attaches a sender to each), numbered by
the RL step they come from. Every engine worker echoes that version and a checksum of the bytes it received, and the
sender compares them with what it sent (:func:`rlhf.rollout.weights.senders.check_delivery`).
:meth:`RolloutBackend.versions` reads back what each engine holds.

Pause and resume (partial rollouts, ``rollout.partial_rollout_tokens``) need no methods of their own. A generation
pauses at a token count, not a moment: it asks for the first ``c`` tokens (``SamplingSpec.max_new_tokens``), and it
resumes with ``generate`` from the prompt and those tokens once the new weights have landed. The KV cache is
recomputed under the new weights, as it must be, since the old weights' cache does not hold for them. A pause at a
moment (vLLM's ``pause_generation``) would make a run depend on timing: its samples could not be replayed or
resumed exactly.
"""

from __future__ import annotations

from typing import List, Optional, Protocol, Sequence

from rlhf.rollout.types import Generation, SamplingSpec
from rlhf.rollout.weights.group import SyncTimeouts


class RolloutBackend(Protocol):
    """Sampling, device hand-over, weight transport and versions of a group of rollout engines."""

    @property
    def sleeps(self) -> bool:
        """The engines release their devices between rollouts (the GPU hybrid engine)."""

    @property
    def gpus_per_engine(self) -> float:
        """GPUs each engine uses (0: CPU engines); the weight-sync transport depends on it."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSpec) -> List[Generation]:
        """One completion per entry of ``prompt_ids``, in order; completion ``j`` is drawn with seed
        ``sampling.seed + j`` whichever engine serves it, and carries the log-probs of the distribution sampled."""

    def generate_each(self, prompt_ids: Sequence[Sequence[int]], samplings: Sequence[SamplingSpec]) -> List[Generation]:
        """One completion per entry of ``prompt_ids``, in order, completion ``j`` drawn as ``samplings[j]`` says (its
        own seed as it is, and its own length): the agent endpoint's requests, batched as they arrive."""

    def sleep(self) -> None:
        """Free the devices for training (a no-op unless :attr:`sleeps`)."""

    def wake_weights(self) -> None:
        """Map the weights' memory back before a weight sync (a no-op unless :attr:`sleeps`)."""

    def wake_kv_cache(self) -> None:
        """Map the KV cache back after the weight sync (a no-op unless :attr:`sleeps`)."""

    def connect_weight_sync(
        self,
        policy,
        method: str,
        bucket_bytes: int,
        backend: str,
        timeouts: Optional[SyncTimeouts] = None,
        adapter_only: bool = False,
    ) -> None:
        """Attach a sender to every rank of ``policy`` (the trainable group) for transport ``method``; with
        ``adapter_only`` each sync sends the policy's LoRA adapter alone (``model.lora.sync=adapter``)."""

    def versions(self) -> List[Optional[int]]:
        """The weight version each engine holds (0: the model it started from; None: an update not numbered)."""

    def shutdown(self) -> None:
        """Stop the engines."""
