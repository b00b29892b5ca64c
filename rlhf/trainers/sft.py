"""Supervised fine-tuning on ``{"prompt", "response"}`` rows; loss on response tokens only."""
from __future__ import annotations

from rlhf.config.schema import SFTRunConfig
from rlhf.data.io import read_rows
from rlhf.data.tokenize import collate_sft, tokenize_sft
from rlhf.models.loading import CAUSAL_LM
from rlhf.objectives.sft import SFTObjective
from rlhf.trainers.offline import OfflineTask, RunResult
from rlhf.trainers.runner import run_offline


def build_sft_task(cfg: SFTRunConfig, tokenizer) -> tuple:
    d = cfg.data
    rows = read_rows(d.train_path, required=(d.prompt_key, d.response_key), split=d.split)
    tok = tokenize_sft(rows, tokenizer, max_length=d.max_length, prompt_key=d.prompt_key,
                       response_key=d.response_key, add_eos=d.add_eos)
    examples, pad = tok.examples, tokenizer.pad_token_id
    task = OfflineTask(name="sft", model_kind=CAUSAL_LM, objective=SFTObjective(), num_examples=len(examples),
                       collate=lambda rows_: collate_sft([examples[i] for i in rows_], pad, rows_),
                       console_keys=("loss", "grad_norm", "lr", "num_tokens"))
    return task, tok.skipped_rows


def train_sft(cfg: SFTRunConfig) -> RunResult:
    return run_offline(cfg, build_sft_task, policy_role="policy")
