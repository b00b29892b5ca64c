"""Packing benchmark: real tokens per second of compute-bound SFT on long-tailed data, padded vs packed vs a token
budget, against a plain PyTorch loop (the floor) and TRL's padding-free SFTTrainer.

    python bench/bench_packing.py [--workdir DIR] [--steps 12] [--global-batch 16] [--micro 4] [--max-tokens 2048]
                                  [--modes padded,packed,budget,floor,floor-packed,trl] [--trl-path DIR] [--uniform]

The model is a 24.7M-parameter Qwen2 (hidden 512, 8 layers, 8 heads / 2 KV heads, MLP 1536; fp32), big enough that
a step is compute-bound on CPU; the data are long-tailed SFT rows (rlhf.synthetic.long_tail: log-normal lengths,
median ~80 tokens, clipped to 16..1024). Every mode trains the same global batches in the same order (the
project's EpochPlan for ``train.seed``), one rank with 2 threads, AdamW (betas 0.9/0.95, no weight decay), gradient
clipping at 1.0, cosine LR, fp32:

* padded       ``python -m rlhf.cli.train_sft`` with ``train.micro_batch_size=--micro`` (micro-batches padded to
               their longest row);
* packed       the same with ``train.packing=true``;
* budget       ``train.packing=true train.max_tokens_per_micro_batch=--max-tokens``;
* floor        a plain single-process PyTorch loop (HF model, cross_entropy, AdamW, clip_grad_norm_) over the same
               micro-batches, padded like ``padded``;
* floor-packed the plain loop with each micro-batch packed into one row (position_ids restart per row, no padding);
* trl          TRL's SFTTrainer (``padding_free=True``, same micro-batches and accumulation), run in a subprocess
               with ``--trl-path`` on PYTHONPATH; skipped when TRL does not import.

A mode whose run fails (e.g. a budget below the longest row) is reported with the run's last lines. ``--uniform``
reproduces the compute-bound case of issue #13 instead: 72-token rows, global batch 8 = micro 8.

Prints (figures, not pass/fail): the data's length report; per mode the median step time, real tokens/s (prompt +
response + EOS, no padding) and target tokens/s over the timed steps (the first ``--warmup`` are excluded), the
share of computed positions that were padding, and each mode's tokens/s over the floor's (and over floor-packed's).
Project step times are the run's own ``step_time_s`` (metrics.jsonl: collate + Ray round trip + the step); the
loops' are wall time per optimizer step including collation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536)
ALL_MODES = ("padded", "packed", "budget", "floor", "floor-packed", "trl")
LR, BETAS, EPS, CLIP, WARMUP = 1e-4, (0.9, 0.95), 1e-8, 1.0, 2


# ------------------------------------------------------------------------------------------- data and plan
def make_data(work: str, args) -> tuple:
    from rlhf.synthetic.arithmetic import write_jsonl
    from rlhf.synthetic.long_tail import (
        UNIFORM_72,
        LengthSpec,
        format_report,
        length_report,
        make_sft_rows,
        sft_lengths,
    )

    spec = UNIFORM_72 if args.uniform else LengthSpec(median=args.median, sigma=args.sigma, max_tokens=args.max_len)
    rows = make_sft_rows(args.rows, args.seed, spec)
    path = write_jsonl(os.path.join(work, "uniform.jsonl" if args.uniform else "long_tail.jsonl"), rows)
    print(format_report(length_report(sft_lengths(rows)), f"data ({path})"), flush=True)
    return path, spec


def tokenized(model_dir: str, data: str, max_len: int):
    from transformers import AutoTokenizer

    from rlhf.data.io import read_rows
    from rlhf.data.tokenize import tokenize_sft

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = read_rows(data, required=("prompt", "response"))
    examples = tokenize_sft(rows, tok, max_length=max_len, prompt_key="prompt", response_key="response").examples
    return tok, examples


def step_plan(num_examples: int, global_batch: int, steps: int, seed: int) -> list:
    """Row indices of optimizer steps 1..steps, exactly as the project's run takes them."""
    from rlhf.data.plan import EpochPlan

    plan = EpochPlan(
        num_samples=num_examples, global_batch_size=global_batch, max_epochs=10**6, max_steps=steps, seed=seed
    )
    return [s.indices for s in plan.steps()]


def micro_batches(indices: list, micro: int) -> list:
    return [indices[i : i + micro] for i in range(0, len(indices), micro)]


def padded_positions(lengths_of_step: list, micro: int) -> int:
    """Positions computed when each micro-batch is padded to its longest row."""
    return sum(len(mb) * max(mb) for mb in micro_batches(lengths_of_step, micro))


# ------------------------------------------------------------------------------------------- the project's CLI
def run_project(name: str, model_dir: str, data: str, work: str, args, extra: list) -> dict:
    run_dir = os.path.join(work, "runs", name)
    overrides = [
        f"model.path={model_dir}",
        f"data.train_path={data}",
        f"train.output_dir={run_dir}",
        f"data.max_length={args.max_len}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro}",
        "train.num_workers=1",
        "strategy.cpus_per_worker=2",
        "strategy.zero_stage=0",
        "strategy.precision=fp32",
        f"train.max_steps={args.steps}",
        "train.max_epochs=1000000",
        f"train.lr={LR}",
        f"train.warmup_steps={WARMUP}",
        "train.weight_decay=0.0",
        f"train.max_grad_norm={CLIP}",
        f"train.seed={args.seed}",
        "train.save_final=false",
        "train.overwrite=true",
        "logging.tensorboard=false",
        "logging.print_every=1000",
        "health.action=warn",
        *extra,
    ]
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.train_sft", *overrides], capture_output=True, text=True, cwd=REPO
    )
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if done.returncode != 0 or not os.path.exists(metrics):
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        return {"skipped": f"train_sft exited {done.returncode}:\n{tail}"}
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "step_time_s" in r]
    return {
        "steps": {r["step"]: r["step_time_s"] for r in rows},
        "targets": {r["step"]: r["num_tokens"] for r in rows},
        "wall_s": time.time() - started,
    }


# ------------------------------------------------------------------------------------------- the floor (plain loop)
def floor_worker(cfg: dict) -> dict:
    """A plain PyTorch loop over the plan's micro-batches; runs in its own process (``--_worker floor CFG``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.utils.schedule import lr_multiplier

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    tok, examples = tokenized(cfg["model"], cfg["data"], cfg["max_len"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    total = len(cfg["plan"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_multiplier(s, total_steps=total, warmup_steps=WARMUP, kind="cosine", min_ratio=0.0)
    )
    pad = tok.pad_token_id

    def padded_micro(rows):
        width = max(len(examples[i].input_ids) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        tgt = torch.zeros((len(rows), width), dtype=torch.bool)
        for r, i in enumerate(rows):
            e = examples[i]
            ids[r, : len(e.input_ids)] = torch.tensor(e.input_ids)
            att[r, : len(e.input_ids)] = 1
            tgt[r, : len(e.input_ids)] = torch.tensor(e.loss_mask, dtype=torch.bool)
        return {"input_ids": ids, "attention_mask": att}, ids, tgt

    def packed_micro(rows):
        ids = torch.tensor([t for i in rows for t in examples[i].input_ids]).unsqueeze(0)
        pos = torch.tensor([p for i in rows for p in range(len(examples[i].input_ids))]).unsqueeze(0)
        tgt = torch.tensor([m for i in rows for m in examples[i].loss_mask], dtype=torch.bool).unsqueeze(0)
        return {"input_ids": ids, "position_ids": pos}, ids, tgt  # each row's first token is never a target

    build = packed_micro if cfg["packed"] else padded_micro
    times, losses = [], []
    for indices in cfg["plan"]:
        started = time.perf_counter()
        micros = [build(mb) for mb in micro_batches(indices, cfg["micro"])]
        normalizer = sum(int(t[:, 1:].sum()) for _, _, t in micros)
        loss_sum = 0.0
        for inputs, ids, tgt in micros:
            logits = model(**inputs).logits[:, :-1]
            labels = ids[:, 1:].masked_fill(~tgt[:, 1:], -100)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )
            (loss / normalizer).backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        losses.append(loss_sum / normalizer)
    return {"steps": {i + 1: t for i, t in enumerate(times)}, "loss": losses}


# ------------------------------------------------------------------------------------------- TRL
def trl_worker(cfg: dict) -> dict:
    """TRL's SFTTrainer, padding-free, over the plan's rows in plan order (``--_worker trl CFG``)."""
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from rlhf.data.io import read_rows

    torch.set_num_threads(cfg["threads"])
    rows = read_rows(cfg["data"], required=("prompt", "response"))
    order = [i for step in cfg["plan"] for i in step]
    dataset = Dataset.from_list([{"prompt": rows[i]["prompt"], "completion": rows[i]["response"]} for i in order])
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32, attn_implementation="sdpa")

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_train_begin(self, *a, **k):
            self.marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            self.marks.append(time.perf_counter())

    class InPlanOrder(SFTTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    clock = Clock()
    args = SFTConfig(
        output_dir=cfg["out"],
        per_device_train_batch_size=cfg["micro"],
        gradient_accumulation_steps=cfg["global_batch"] // cfg["micro"],
        max_steps=len(cfg["plan"]),
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=0.0,
        max_grad_norm=CLIP,
        lr_scheduler_type="cosine",
        warmup_steps=WARMUP,
        padding_free=True,
        max_length=None,
        bf16=False,
        fp16=False,
        use_cpu=True,
        optim="adamw_torch",
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        dataloader_num_workers=0,
        seed=0,
        dataset_num_proc=None,
        disable_tqdm=True,
    )
    trainer = InPlanOrder(model=model, args=args, train_dataset=dataset, processing_class=tok, callbacks=[clock])
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    trainer.train()
    marks = clock.marks
    times = [b - a for a, b in zip(marks, marks[1:])]
    g = cfg["global_batch"]
    return {
        "steps": {i + 1: t for i, t in enumerate(times)},
        "tokens": {i + 1: sum(lengths[i * g : (i + 1) * g]) for i in range(len(times))},
        "attn": getattr(model.config, "_attn_implementation", "?"),
    }


def run_worker(kind: str, cfg: dict, work: str, pythonpath: str = "") -> dict:
    path = os.path.join(work, f"{kind}-{cfg['name']}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, REPO, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_worker", kind, path], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        return {"skipped": f"{kind} worker exited {done.returncode}:\n{tail}"}
    with open(path + ".out") as f:
        out = json.load(f)
    out["steps"] = {int(k): v for k, v in out["steps"].items()}
    if "tokens" in out:
        out["tokens"] = {int(k): v for k, v in out["tokens"].items()}
    return out


def trl_importable(trl_path: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (trl_path, REPO) if p))
    done = subprocess.run(
        [sys.executable, "-c", "import trl, sys; print(trl.__version__)"], capture_output=True, text=True, env=env
    )
    return done.stdout.strip() if done.returncode == 0 else ""


# ------------------------------------------------------------------------------------------- report
def summarise(name: str, result: dict, plan_tokens: list, plan_targets: list, padded: list, warmup: int) -> dict:
    steps = result["steps"]
    timed = [s for s in sorted(steps) if s > warmup]
    secs = sum(steps[s] for s in timed)
    tokens = result.get("tokens") or {s: plan_tokens[s - 1] for s in steps}
    real = sum(tokens[s] for s in timed)
    targets = sum(plan_targets[s - 1] for s in timed)
    pad = None if padded is None else (1 - real / sum(padded[s - 1] for s in timed) if padded else 0.0)
    return {
        "mode": name,
        "timed": len(timed),
        "median_s": statistics.median(steps[s] for s in timed),
        "tok_s": real / secs,
        "tgt_s": targets / secs,
        "pad": pad,
    }


def pad_text(pad) -> str:
    return "-" if pad is None else f"{100 * pad:.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--global-batch", type=int, default=None, help="rows per optimizer step (default 16; 8 --uniform)")
    ap.add_argument("--micro", type=int, default=None, help="rows per padded micro-batch (default 4; 8 --uniform)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="train.max_tokens_per_micro_batch for `budget`")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--median", type=float, default=80.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=1024, help="longest row (tokens); also data.max_length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma-separated subset of {','.join(ALL_MODES)}")
    ap.add_argument("--trl-path", default="", help="directory with TRL on it, added to PYTHONPATH of the TRL run")
    ap.add_argument("--uniform", action="store_true", help="72-token rows, global batch 8 = micro 8 (issue #13)")
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._worker:
        kind, path = args._worker
        with open(path) as f:
            cfg = json.load(f)
        out = floor_worker(cfg) if kind == "floor" else trl_worker(cfg)
        with open(path + ".out", "w") as f:
            json.dump(out, f)
        return 0

    if args.uniform:
        args.global_batch, args.micro, args.max_len = args.global_batch or 8, args.micro or 8, 128
    args.global_batch, args.micro = args.global_batch or 16, args.micro or 4
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; valid: {','.join(ALL_MODES)}")
    work = args.workdir or tempfile.mkdtemp(prefix="rlhf-bench-packing-")
    os.makedirs(work, exist_ok=True)
    from rlhf.cli.common import quiet_environment

    quiet_environment()
    from rlhf.models.tiny import build_tiny_model

    model_dir = os.path.join(work, "model-1024")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_model(model_dir, seed=0, max_position_embeddings=1024, **MODEL)
    data, _ = make_data(work, args)
    _, examples = tokenized(model_dir, data, args.max_len)
    plan = step_plan(len(examples), args.global_batch, args.steps, args.seed)
    lengths = [[len(examples[i].input_ids) for i in step] for step in plan]
    plan_tokens = [sum(ls) for ls in lengths]
    plan_targets = [sum(examples[i].num_targets for i in step) for step in plan]
    padded = [padded_positions(ls, args.micro) for ls in lengths]
    print(
        f"== {args.steps} steps of global batch {args.global_batch} (micro {args.micro}), {len(examples)} rows; "
        f"real tokens per step: median {statistics.median(plan_tokens):.0f}, max {max(plan_tokens)}; padded "
        f"micro-batches would compute {sum(padded) / sum(plan_tokens):.2f}x the real tokens; work dir {work}",
        flush=True,
    )
    worker_cfg = dict(
        model=model_dir,
        data=data,
        max_len=args.max_len,
        plan=plan,
        micro=args.micro,
        global_batch=args.global_batch,
        threads=2,
    )
    results, rows = {}, []
    for mode in modes:
        started = time.time()
        if mode == "padded":
            res = run_project(mode, model_dir, data, work, args, [])
        elif mode == "packed":
            res = run_project(mode, model_dir, data, work, args, ["train.packing=true"])
        elif mode == "budget":
            res = run_project(
                mode,
                model_dir,
                data,
                work,
                args,
                ["train.packing=true", f"train.max_tokens_per_micro_batch={args.max_tokens}"],
            )
        elif mode in ("floor", "floor-packed"):
            res = run_worker("floor", dict(worker_cfg, name=mode, packed=mode == "floor-packed"), work)
        else:
            version = trl_importable(args.trl_path)
            res = (
                run_worker("trl", dict(worker_cfg, name=mode, out=os.path.join(work, "trl-out")), work, args.trl_path)
                if version
                else {"skipped": f"`import trl` fails (--trl-path={args.trl_path or 'unset'})"}
            )
            if version and "skipped" not in res:
                print(f"  (TRL {version}, attention {res.get('attn')})", flush=True)
        if "skipped" in res:
            print(f"  {mode:<13} skipped: {res['skipped']}", flush=True)
            continue
        if "tokens" in res:  # TRL tokenized the rows itself: say so if it did not get the same tokens
            differ = [s for s in res["tokens"] if res["tokens"][s] != plan_tokens[s - 1]]
            if differ:
                print(f"  note: {mode} saw other token counts than the plan at steps {differ[:5]}", flush=True)
        # padding share: known for the padded modes, 0 for the padding-free loops, unknown for the project's packing
        row = summarise(
            mode,
            res,
            plan_tokens,
            plan_targets,
            padded if mode in ("padded", "floor") else ([] if mode in ("floor-packed", "trl") else None),
            args.warmup,
        )
        results[mode] = row
        rows.append(row)
        print(
            f"  {mode:<13} median {row['median_s']:.3f} s/step  {row['tok_s']:8.1f} real tok/s  "
            f"{row['tgt_s']:8.1f} target tok/s  padding {pad_text(row['pad'])}  ({time.time() - started:.0f} s)",
            flush=True,
        )
    if rows:
        print(f"== summary (steps {args.warmup + 1}..{args.steps}; ratios are real tokens/s over the loop's)")
        print(f"  {'mode':<13} {'s/step':>7} {'tok/s':>8} {'padding':>8} {'/floor':>7} {'/floor-packed':>14}")
        for row in rows:
            ratio = lambda ref: f"{row['tok_s'] / results[ref]['tok_s']:.2f}x" if ref in results else "-"  # noqa
            print(
                f"  {row['mode']:<13} {row['median_s']:7.3f} {row['tok_s']:8.1f} {pad_text(row['pad']):>8} "
                f"{ratio('floor'):>7} {ratio('floor-packed'):>14}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
