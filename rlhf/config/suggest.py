"""What an unknown config key probably meant: this project's name for a key other toolkits spell differently
(HF Trainer / TRL, OpenRLHF, verl), a key with the same last part in another section, or a close spelling.

Used by the loader's unknown-key errors and by the command line's hint for ``--key value`` arguments.
"""

from __future__ import annotations

import difflib
from typing import Dict, List, Sequence, Tuple

_ACCUMULATION = (
    "gradient accumulation is derived here, not set: train.global_batch_size / "
    "(train.micro_batch_size x train.num_workers) micro-batches per rank per optimizer step"
)
_WARMUP = "train.warmup_steps counts optimizer steps, not a fraction of the run"
_SAMPLES = "train.global_batch_size counts samples per optimizer step; rollout.prompts_per_step counts prompts"

# A name used elsewhere (its last dotted part, lower case, "-" read as "_") -> (this project's keys, a note).
# Only the keys the run config has are suggested (dpo.beta for DPO, algo.kl_coef for RL).
FOREIGN_KEYS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    # model and data
    "model_name_or_path": (("model.path",), ""),  # HF / TRL
    "pretrain": (("model.path",), ""),  # OpenRLHF
    "ref_pretrain": (("model.ref_path",), ""),
    "reward_pretrain": (("reward.model_path",), ""),
    "critic_pretrain": (("critic.path",), ""),
    "tokenizer_name": (("model.tokenizer_path",), ""),
    "tokenizer_name_or_path": (("model.tokenizer_path",), ""),
    "flash_attn": (("model.attn_implementation",), ""),
    "dataset": (("data.train_path",), ""),
    "dataset_name": (("data.train_path",), ""),
    "prompt_data": (("data.train_path",), ""),
    "train_files": (("data.train_path",), ""),  # verl
    "eval_dataset": (("data.eval_path",), ""),
    "val_files": (("data.eval_path",), ""),
    "dataset_config": (("data.config_name",), ""),  # TRL
    "dataset_config_name": (("data.config_name",), ""),
    "apply_chat_template": (
        ("data.chat_template", "data.template_text_prompts"),
        "conversational rows use the tokenizer's template (auto); RL text prompts: data.template_text_prompts=true",
    ),
    "chat_template_path": (("data.chat_template",), ""),
    "assistant_only_loss": (("data.assistant_turns",), "conversational rows train on assistant tokens only"),
    "input_key": (("data.prompt_key",), ""),
    "output_key": (("data.response_key",), ""),
    "max_len": (("data.max_length",), ""),
    "max_seq_length": (("data.max_length",), ""),
    "prompt_max_len": (("rollout.max_prompt_length", "data.max_length"), ""),
    "max_completion_length": (("rollout.max_new_tokens",), ""),  # TRL GRPO
    "generate_max_len": (("rollout.max_new_tokens",), ""),  # OpenRLHF
    "max_response_length": (("rollout.max_new_tokens",), ""),  # verl
    # batch sizes and length of the run
    "per_device_train_batch_size": (("train.micro_batch_size",), ""),
    "micro_train_batch_size": (("train.micro_batch_size",), ""),
    "ppo_micro_batch_size_per_gpu": (("train.micro_batch_size",), ""),
    "gradient_accumulation_steps": (("train.global_batch_size",), _ACCUMULATION),
    "train_batch_size": (("train.global_batch_size", "rollout.prompts_per_step"), _SAMPLES),
    "ppo_mini_batch_size": (("train.global_batch_size",), _SAMPLES),
    "rollout_batch_size": (("rollout.prompts_per_step",), ""),
    "num_generations": (("rollout.n_samples_per_prompt",), ""),
    "n": (("rollout.n_samples_per_prompt",), ""),  # verl rollout.n
    "num_train_epochs": (("train.max_epochs",), ""),
    "total_epochs": (("train.max_epochs",), ""),
    "total_training_steps": (("train.max_steps",), ""),
    "num_iterations": (("algo.ppo_epochs",), ""),
    # optimisation
    "learning_rate": (("train.lr",), ""),
    "actor_learning_rate": (("train.lr",), ""),
    "critic_learning_rate": (("critic.lr",), ""),
    "lr_scheduler_type": (("train.lr_scheduler",), ""),
    "warmup_ratio": (("train.warmup_steps",), _WARMUP),
    "lr_warmup_ratio": (("train.warmup_steps",), _WARMUP),
    "adam_beta1": (("train.adam_betas",), ""),
    "adam_beta2": (("train.adam_betas",), ""),
    "adam_epsilon": (("train.adam_eps",), ""),
    "grad_clip": (("train.max_grad_norm",), ""),
    "bf16": (("strategy.precision",), "strategy.precision=bf16, fp32 or auto"),
    "fp16": (("strategy.precision",), "strategy.precision=bf16, fp32 or auto; fp16 is not supported"),
    "deepspeed": (("strategy.deepspeed_config",), ""),
    # algorithms
    "beta": (("dpo.beta", "algo.kl_coef"), ""),  # TRL / OpenRLHF DPO; TRL GRPO's KL coefficient
    "rpo_alpha": (("dpo.nll_coef",), ""),  # TRL DPO
    "cpo_alpha": (("dpo.nll_coef",), "dpo.loss_type=cpo trains with dpo.nll_coef 1 unless set"),  # TRL CPO
    "nll_loss_coef": (("dpo.nll_coef",), ""),  # OpenRLHF
    "gamma_beta_ratio": (("dpo.simpo_gamma",), "dpo.simpo_gamma is gamma itself: gamma_beta_ratio x dpo.beta"),
    "reference_free": (("dpo.loss_type",), "dpo.loss_type=simpo, cpo or orpo read no reference model"),  # TRL DPO
    "init_kl_coef": (("algo.kl_coef",), ""),
    "kl_loss_coef": (("algo.kl_coef",), ""),
    "adv_estimator": (("algo.advantage_estimator",), ""),
    "eps_clip": (("algo.clip_low", "algo.clip_high"), ""),
    "epsilon": (("algo.clip_low", "algo.clip_high"), ""),
    "clip_ratio": (("algo.clip_low", "algo.clip_high"), ""),
    "epsilon_high": (("algo.clip_high",), ""),
    "entropy_coeff": (("algo.entropy_coef",), ""),
    "vllm_num_engines": (("rollout.num_engines",), ""),
    "vllm_tensor_parallel_size": (("rollout.tensor_parallel_size",), ""),
    "tensor_model_parallel_size": (("rollout.tensor_parallel_size",), ""),
    "vllm_gpu_memory_utilization": (("rollout.gpu_memory_utilization",), ""),
    # output, checkpoints, logging
    "save_path": (("train.output_dir",), ""),
    "ckpt_path": (("train.output_dir",), ""),
    "default_local_dir": (("train.output_dir",), ""),
    "overwrite_output_dir": (("train.overwrite",), ""),
    "save_steps": (("train.save_every",), ""),
    "save_freq": (("train.save_every",), ""),
    "save_total_limit": (("train.keep_checkpoints",), ""),
    "max_ckpt_num": (("train.keep_checkpoints",), ""),
    "resume_from_checkpoint": (("train.resume",), ""),
    "load_checkpoint": (("train.resume",), ""),
    "eval_steps": (("train.eval_every",), ""),
    "test_freq": (("train.eval_every",), ""),
    "logging_steps": (("logging.print_every",), ""),
    "report_to": (("logging.wandb", "logging.tensorboard"), ""),
    "use_wandb": (("logging.wandb",), ""),
    "use_tensorboard": (("logging.tensorboard",), ""),
    "run_name": (("logging.wandb_run_name",), ""),
}


def suggest_keys(key: str, valid: Sequence[str], limit: int = 3) -> Tuple[List[str], str]:
    """Keys of ``valid`` that ``key`` probably meant, best first, and a note to show with them (or ``""``).

    A name from :data:`FOREIGN_KEYS` (bare, or under any section: ``learning_rate``, ``train.learning_rate``)
    gives its mapped keys only; otherwise keys with the same last part, then close spellings. ``key`` itself is
    never suggested, nor a section it is written in.
    """
    leaf = key.rsplit(".", 1)[-1]
    name = leaf.strip().lower().replace("-", "_")
    targets, note = FOREIGN_KEYS.get(name, ((), ""))
    mapped = [k for k in targets if k in valid and k != key]
    if mapped:
        return mapped[:limit], note
    same_leaf = [k for k in valid if k.rsplit(".", 1)[-1] in (leaf, name)]
    close = close_matches(key, valid)
    # Neither the key itself nor a section it is already in ('strategy' for 'strategy.zero'; 'train.lr' for
    # 'train.lr.x' is a leaf, and a fair guess).
    sections = {k.rsplit(".", 1)[0] for k in valid if "." in k}
    return [
        k for k in dict.fromkeys(same_leaf + close) if k != key and not (k in sections and key.startswith(k + "."))
    ][:limit], ""


def close_matches(key: str, candidates: Sequence[str], cutoff: float = 0.6, spread: float = 0.1) -> List[str]:
    """Candidates similar to ``key``: above ``cutoff`` and within ``spread`` of the best match, best first."""
    scored = sorted(((difflib.SequenceMatcher(None, key, c).ratio(), c) for c in candidates), key=lambda sc: -sc[0])
    best = scored[0][0] if scored else 0.0
    return [c for score, c in scored[:3] if score >= cutoff and score >= best - spread]
