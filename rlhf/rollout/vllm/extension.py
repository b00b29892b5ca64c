"""Methods added to every vLLM worker (``LLM(..., worker_extension_cls=...)``) to receive policy weights.

vLLM mixes this class into its worker, so ``self`` is the worker and ``self.model_runner.model`` the model. The
method names carry an ``rlhf_`` prefix: a name that clashes with one of the worker's own methods would silently
replace it (``update_weights`` does).

Three transports carry the same packed buckets (``rlhf.rollout.weights.senders``), and all load them the same way:

* broadcast: :meth:`rlhf_join_weight_group` joins the weight-sync process group once (NCCL on GPUs, gloo on
  CPU), then :meth:`rlhf_receive_bucket` receives each bucket straight into device memory;
* ipc: :meth:`rlhf_load_shared_bucket` opens the colocated policy rank's bucket by CUDA-IPC handle (shared
  memory on CPU);
* object store: :meth:`rlhf_load_bucket` gets the bucket's bytes through ``LLM.collective_rpc``.

An update carries the whole model, or (``model.lora.sync=adapter``) a LoRA adapter alone, which the worker installs
as its one adapter (:mod:`rlhf.rollout.vllm.adapters`) and the engine then names in every request.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from rlhf.rollout.vllm.adapters import install_adapter
from rlhf.rollout.weights.group import GroupAddress, SyncGroup
from rlhf.rollout.weights.ipc import open_shared
from rlhf.rollout.weights.sync import bucket_checksum, bucket_from_bytes, metas_from_wire, unpack_bucket

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

    # For the type checker only: bare annotations create no class attributes, so vLLM's check that the extension
    # adds no name the worker already has (``dir``) sees none of them. The first two are the vLLM worker's own.
    model_runner: Any  # the worker's GPU/CPU model runner (``.model``, ``.device``, ``.vllm_config``)
    rank: int  # the worker's rank within its engine (tensor parallel)
    _rlhf_opened: Dict[bytes, torch.Tensor]  # IPC handle -> the tensor it opened, during one update
    _rlhf_group: SyncGroup  # the broadcast transport's group (rlhf_join_weight_group)
    _rlhf_update: Dict[str, Any]  # the update in progress: its version, the bytes loaded and their checksum
    _rlhf_adapter: Optional[Tuple[dict, Dict[str, torch.Tensor]]]  # an adapter update: its config, tensors so far
    _rlhf_lora_id: int  # the LoRA id of the adapter installed last (0: none yet)

    def rlhf_begin_weight_update(self, version: Optional[int] = None, adapter: Optional[dict] = None) -> None:
        """Start the update to weight ``version`` (the RL step whose weights these are; None: not numbered).

        ``adapter`` (a PEFT config, ``model.lora.sync=adapter``): the buckets carry a LoRA adapter, collected
        until :meth:`rlhf_finish_weight_update` installs it; the base weights are not touched."""
        self._rlhf_opened = {}  # IPC handles opened during this update (a failed earlier update's are dropped)
        self._rlhf_start_record(version)
        self._rlhf_adapter = (adapter, {}) if adapter is not None else None
        if adapter is None:
            from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

            _quiet_buffer_only_layers()
            initialize_layerwise_reload(self.model_runner.model)

    def rlhf_finish_weight_update(self, expected: Optional[list] = None) -> Dict[str, Any]:
        """End the update; returns what this worker received (``version``, ``bytes``, ``checksum``: the sum of
        :func:`~rlhf.rollout.weights.sync.bucket_checksum` over its buckets), which the sender compares with what it
        sent (:func:`rlhf.rollout.weights.senders.check_delivery`).

        An adapter update is installed only when ``expected`` (the ``[bytes, checksum]`` sent) is what arrived;
        the record then adds the adapter's LoRA id (``lora_id``), this worker's read-back of it (``resident``) and
        ``tensor_parallel_size``. An incomplete adapter is dropped: the worker keeps serving the last one."""
        adapter = getattr(self, "_rlhf_adapter", None)
        self._rlhf_adapter = None
        if adapter is not None:
            self._rlhf_opened = {}
            record = self._rlhf_record()
            if [record["bytes"], record["checksum"]] != list(expected or ()):
                return record
            return {**record, **self._rlhf_install_adapter(*adapter)}
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.model_runner.vllm_config.model_config)
        self._rlhf_opened = {}  # closes the IPC handles: each gives its one reference back to the sender
        # reset_lora_state drops any adapter too: a LoRA engine takes adapter syncs only (VLLMEngine)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        return self._rlhf_record()

    def _rlhf_install_adapter(self, config: dict, tensors: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        """The collected adapter becomes this worker's one adapter, under the next LoRA id (every worker of an
        engine counts its adapter updates in lockstep, so they agree on it)."""
        lora_id = getattr(self, "_rlhf_lora_id", 0) + 1
        resident = install_adapter(self.model_runner, lora_id, tensors, config)
        self._rlhf_lora_id = lora_id  # only once installed: a failed adapter leaves the last one and its id
        parallel = self.model_runner.vllm_config.parallel_config.tensor_parallel_size
        return {"lora_id": lora_id, "resident": resident, "tensor_parallel_size": parallel}

    # The record of an update (also kept by bench/gpu_check.py's stand-in for a worker, which has no vLLM reload).
    def _rlhf_start_record(self, version: Optional[int]) -> None:
        self._rlhf_update = {"version": version, "bytes": 0, "checksum": 0}

    def _rlhf_record(self) -> Dict[str, Any]:
        return dict(getattr(self, "_rlhf_update", {"version": None, "bytes": 0, "checksum": 0}))

    def rlhf_load_bucket(self, metas: list, payload: bytes) -> int:
        """Object-store transport: one bucket's bytes (``WeightBucket.wire_metas()`` + bytes)."""
        return self._rlhf_load(metas, bucket_from_bytes(payload))

    def rlhf_join_weight_group(self, address: dict, rank_offset: int) -> None:
        """Broadcast transport: join the weight-sync group (``GroupAddress.to_wire()``) as rank ``rank_offset`` +
        this worker's TP rank."""
        rank = rank_offset + self.rank  # the vLLM worker's rank within its engine (tensor parallel)
        self._rlhf_group = SyncGroup(GroupAddress.from_wire(address), rank=rank)

    def rlhf_receive_bucket(self, metas: list, nbytes: int) -> int:
        """Broadcast transport: receive one bucket from rank 0 into a new buffer (never reused: the reload keeps
        references to loaded tensors until their layer is complete) and load it."""
        group = self._rlhf_group
        data = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(data, src=0)
        return self._rlhf_load(metas, data)

    def rlhf_load_shared_bucket(self, metas: list, handle, nbytes: int) -> int:
        """IPC transport: the policy rank's packed bucket on this device. It is copied out first: the sender
        reuses its buffer for the next bucket, and the reload keeps references until a layer is complete. The
        sender hands the same handle for every bucket its buffer carries in one update: it is opened once, and
        kept open until :meth:`rlhf_finish_weight_update`."""
        opened = getattr(self, "_rlhf_opened", None)
        if opened is None:
            opened = self._rlhf_opened = {}
        if handle not in opened:
            opened[handle] = open_shared(handle)
        return self._rlhf_load(metas, opened[handle][:nbytes].clone())

    def _rlhf_load(self, metas: list, data: torch.Tensor) -> int:
        update = getattr(self, "_rlhf_update", None)
        if update is not None:  # counted as received, before anything of it is loaded
            update["bytes"] += data.numel()
            update["checksum"] += bucket_checksum(data, data.numel())
        adapter = getattr(self, "_rlhf_adapter", None)
        if adapter is not None:  # views of this update's own buffer (never the sender's): vLLM scales B in place
            adapter[1].update(unpack_bucket(metas_from_wire(metas), data))
            return len(metas)
        device = self.model_runner.device  # not the parameters' device: mid-reload they live on "meta"
        weights = [(name, tensor.to(device)) for name, tensor in unpack_bucket(metas_from_wire(metas), data)]
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)
