"""A LoRA adapter installed into a running vLLM worker from memory: the engine side of ``model.lora.sync=adapter``.

vLLM loads adapters from a directory named in a ``LoRARequest``. An RL sync instead hands the worker the adapter's
tensors (the weight-sync buckets, :mod:`rlhf.rollout.vllm.extension`), so :func:`install_adapter` builds vLLM's
``LoRAModel`` from them with the arguments vLLM's own loader passes (``WorkerLoRAManager._load_adapter``),
registers it under a new LoRA id, and activates it. Requests then name that id with a placeholder path
(:func:`lora_request`); vLLM reads a path only for an id it does not hold, which the engine never sends.

What vLLM does not do here, and this module does:

* Names are checked: ``LoRAModel.from_lora_tensors`` keeps tensors of modules vLLM never wraps (``lm_head``,
  ``embed_tokens`` on Qwen2) and computes without them; here such a name is an error.
* The new adapter is built before the old one is evicted: an adapter that fails to build leaves the engine serving
  the last one (and the sync stops the run).
* The resident read-back (:func:`resident_sums`): what the worker's LoRA layers will compute with, summed, for the
  sender to compare with what it sent (:func:`rlhf.rollout.weights.senders.check_adapter_residence`).

vLLM internals used: ``model_runner.lora_manager`` (an ``LRUCacheWorkerLoRAManager``), its ``_adapter_manager``
(``LRUCacheLoRAModelManager``: ``add_adapter`` / ``activate_adapter`` / ``remove_adapter``, ``modules`` with their
``lora_a_stacked`` / ``lora_b_stacked`` slots), ``PEFTHelper`` and ``LoRAModel.from_lora_tensors``: vLLM 0.32.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Set

import torch

PLACEHOLDER_ROOT = "/rlhf-lora/policy"  # absolute: vLLM takes an absolute path as is (a relative one is a hub id)


def lora_request(lora_id: int, version: Any):
    """The ``LoRARequest`` every generation of the adapter ``lora_id`` (weight ``version``) carries. Name and path
    both carry the id: a prefix cache keys blocks by them, so no block of an older adapter is ever reused."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(
        lora_name=f"policy_v{version}_{lora_id}", lora_int_id=lora_id, lora_path=f"{PLACEHOLDER_ROOT}/{lora_id}"
    )


def _adapter_manager(model_runner: Any) -> Any:
    manager = getattr(model_runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("this vLLM engine was started without LoRA (enable_lora): it cannot take an adapter")
    return manager


def _expected_modules(adapter_manager: Any) -> Set[str]:
    """The module suffixes an adapter may name: vLLM's wrapped modules, packed ones (``qkv_proj``) as their parts
    (``q_proj``, ``k_proj``, ``v_proj``), as vLLM's own loader computes them."""
    out: Set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        out.update(adapter_manager.packed_modules_mapping.get(module, [module]))
    return out


def check_module_names(names: List[str], adapter_manager: Any, mapper: Any) -> None:
    """Every adapter tensor names a module this engine wraps with LoRA.

    Raises:
        ValueError: listing the names of modules vLLM would silently leave out.
    """
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    expected = _expected_modules(adapter_manager)
    lora_names = [n for n in names if not is_base_embedding_weights(n)]  # PEFT's copies, vLLM skips them too
    unexpected = [n for n in lora_names if parse_fine_tuned_lora_name(n, mapper)[0].rsplit(".", 1)[-1] not in expected]
    if unexpected:
        raise ValueError(
            f"adapter tensors of modules this vLLM engine does not serve with LoRA: {unexpected[:4]}"
            f"{' ...' if len(unexpected) > 4 else ''}; it serves {sorted(expected)}"
        )


def install_adapter(
    model_runner: Any, lora_id: int, tensors: Mapping[str, torch.Tensor], peft_config: Dict[str, Any]
) -> Dict[str, Any]:
    """Make ``tensors`` (PEFT names, ``base_model.model.<path>.lora_{A,B}.weight``; a private buffer's views: vLLM
    scales B in place) the worker's one adapter, under LoRA id ``lora_id`` (>= 1), and return :func:`resident_sums`.

    Raises:
        ValueError: a module vLLM does not wrap, or a config vLLM refuses (rank above the engine's
            ``max_lora_rank``, DoRA, biases); the previous adapter stays in place.
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    worker_manager = _adapter_manager(model_runner)
    manager = worker_manager._adapter_manager
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    check_module_names(list(tensors), manager, mapper)
    helper = PEFTHelper.from_dict(
        {**peft_config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings}
    )
    helper.validate_legal(worker_manager.lora_config)
    adapter = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=dict(tensors),
        peft_helper=helper,
        device="cpu",  # as vLLM's loader: activation copies into the layers' device buffers
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager._validate_modules_to_save(adapter)
    for old in list(manager.list_adapters()):  # which version is resident never depends on LRU order
        manager.remove_adapter(old)
    manager.add_adapter(adapter)
    manager.activate_adapter(lora_id)
    return resident_sums(manager, lora_id)


def resident_sums(adapter_manager: Any, lora_id: int) -> Dict[str, Any]:
    """``sum_a`` = sum |A| and ``sum_b`` = sum |B| (B already scaled by ``alpha / r``) over the slot of ``lora_id``
    in every LoRA layer's stacked buffers, in float64, and ``modules``: how many layers hold a non-zero part.
    Padding (a rank below ``max_lora_rank``, the parts of a packed module the adapter leaves out) is zero."""
    slot = list(adapter_manager.lora_index_to_id).index(lora_id)
    sum_a = sum_b = 0.0
    modules = 0
    for module in adapter_manager.modules.values():
        a_parts = getattr(module, "lora_a_stacked", None)
        b_parts = getattr(module, "lora_b_stacked", None)
        if a_parts is None or b_parts is None:
            continue
        a = sum(float(t[slot].abs().sum(dtype=torch.float64)) for t in a_parts)
        b = sum(float(t[slot].abs().sum(dtype=torch.float64)) for t in b_parts)
        sum_a, sum_b, modules = sum_a + a, sum_b + b, modules + (a > 0 or b > 0)
    return {"sum_a": sum_a, "sum_b": sum_b, "modules": modules}
