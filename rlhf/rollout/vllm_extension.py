"""Methods added to every vLLM worker (``LLM(..., worker_extension_cls=...)``) to receive policy weights.

vLLM mixes this class into its worker, so ``self`` is the worker and ``self.model_runner.model`` the model. The
method names carry an ``rlhf_`` prefix: a name that clashes with one of the worker's own methods would silently
replace it (``update_weights`` does).

Two transports:

* CPU / any device: :meth:`rlhf_load_bucket` receives a packed :class:`~rlhf.rollout.weight_sync.WeightBucket`
  through ``LLM.collective_rpc`` (the Ray object store carries it to the engine actor).
* GPU: :meth:`rlhf_init_weight_group` joins a NCCL group with the policy's rank 0, then
  :meth:`rlhf_receive_broadcast` receives each bucket's tensors by broadcast straight into device memory.
  Selected when the policy and the engines have GPUs; the CPU path is what the tests exercise.
"""
from __future__ import annotations

import logging
from typing import List, Sequence, Tuple

import torch

from rlhf.rollout.weight_sync import WeightBucket, unpack_bucket

_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _BufferOnlyLayerFilter(logging.Filter):
    """Drops "RotaryEmbedding: Failed to load weights", logged on every reload: the rotary layer holds only a
    computed cos/sin buffer, never in a checkpoint, which the reload restores as it was. Any other layer that
    fails to load is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def _quiet_buffer_only_layers() -> None:
    logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _BufferOnlyLayerFilter) for f in logger.filters):
        logger.addFilter(_BufferOnlyLayerFilter())


class WeightSyncExtension:
    """An update is ``rlhf_begin_weight_update`` -> one or more bucket loads -> ``rlhf_finish_weight_update``.

    vLLM post-processes weights after loading (on CPU it repacks every linear layer into a oneDNN handle and
    empties the parameter), so loading checkpoint tensors into the live model is not enough. The begin/finish
    pair uses vLLM's layerwise in-place reload: parameters are restored to checkpoint layout, buckets load
    through the ordinary HF-name loader, and each layer is re-processed once all of its tensors have arrived.
    """

    def rlhf_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        _quiet_buffer_only_layers()
        initialize_layerwise_reload(self.model_runner.model)

    def rlhf_finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.model_runner.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()

    def rlhf_load_bucket(self, metas: list, payload: bytes) -> int:
        """Load one bucket (``WeightBucket.to_wire()``) of HF-named tensors through vLLM's own loader."""
        device = self.model_runner.device  # not the parameters' device: mid-reload they live on "meta"
        bucket = WeightBucket.from_wire(metas, payload)
        weights = [(name, tensor.to(device)) for name, tensor in unpack_bucket(bucket)]
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)

    def rlhf_init_weight_group(self, master_address: str, master_port: int, rank_offset: int,
                               world_size: int) -> None:
        """Join the NCCL group ``{policy rank 0} + every engine worker`` used for GPU weight broadcast."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        rank = rank_offset + torch.distributed.get_rank()
        group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
        self._rlhf_comm = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def rlhf_receive_broadcast(self, metas: list) -> int:
        """Receive one bucket broadcast from the policy's rank 0 (GPU path; ``metas`` as in ``to_wire``)."""
        from rlhf.rollout.weight_sync import _DTYPES

        weights: List[Tuple[str, torch.Tensor]] = []
        for m in WeightBucket.from_wire(metas, b"").metas:
            tensor = torch.empty(m.shape, dtype=_DTYPES[m.dtype], device="cuda")
            self._rlhf_comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            weights.append((m.name, tensor))
        torch.cuda.synchronize()
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)

