"""Seconds per GRPO step, side by side: a plain PyTorch + transformers loop, grpo-lens (lens off / every step), TRL.

One invocation runs every system on the same work, each in its own child process (so that peak memory is per system):

    plain      the reference: a careful GRPO loop written with PyTorch + transformers only (:func:`plain_loop`,
               about 100 lines): ``generate``, one forward + backward of all B*R rollouts with logits only at the
               completion positions (``logits_to_keep``), AdamW.
    plain-naive  the same loop with logits at every position, as a first hand-written loop computes them.
    lens-off   ``grpo_lens.trainer.train`` with ``lens_every = 0``.
    lens-1     ``grpo_lens.trainer.train`` with the lens every step (``lens_every = 1``): the exact Gram read off the
               update's own backward where the loss allows (docs/theory.md §Lens inside the update's backward).
    lens-1-own the lens every step on its own forward + backward (``lens_from_update = false``), as 0.2 did.
    lens-floor lens off with every rollout running its own prompt (``shared_prompt_forward = false``): the pass a lens
               step runs for its mixed groups with the lens itself free, since exact per-rollout gradients need each
               rollout's own backward through its prompt (docs/theory.md §Shared prompts). lens-1 / lens-floor is
               the lens's own cost, lens-floor / lens-off what any exact lens costs in this trainer (its still
               groups also run their own prompt, without gradient, so it is a little above a lens step's floor).
    trl        TRL's ``GRPOTrainer`` with gradient checkpointing off (only when ``trl`` is importable;
               ``pip install -e '.[trl]'``).

Same model (``grpo_lens.models.load_model``), the same B prompts per step (the arithmetic task's prompts for step s
are ``task.sample(B, seed=step_seed(seed, s))``, as grpo-lens draws them), the same sampling settings (temperature,
top_k 0, top_p 1, max_new_tokens), the same reward (``correctness``), loss (sequence-mean of token means, on-policy,
one pass, no KL), AdamW settings, gradient clipping and step count for every system.

Per step the children record wall time and a split measured the same way in every system: ``gen`` is time inside
``model.generate``; ``fwd`` is time inside the model's ``forward`` outside ``generate``; ``bwd`` is time inside
``torch.autograd.backward``; the lens's own forward/backward is excluded from ``fwd``/``bwd`` and shown as ``lens``.
The table shows medians over the measured steps (the first ``--warmup`` steps are dropped), peak memory (CPU: the
child's peak resident set size, which includes the loaded model; CUDA: ``torch.cuda.max_memory_allocated``) and each
system's ratio to the plain loop. The machine is shared: only ratios measured side by side in one run mean much.

Each system's time is also printed against the step's FLOP floor: the FLOPs of the careful plain loop's steps counted
from the model's shape and the padded shapes it ran (benchmarks/common.py: sampling the completions with a KV cache,
then forward + backward of the batch, 6 x linear parameters x tokens, the LM head at the T + 1 kept positions, causal
attention; element-wise work, the optimizer and the reward count 0), divided by the float32 (on a GPU with ``--dtype
bfloat16`` or ``bf16-mixed``: bf16) square-GEMM throughput measured with the same thread count before and after
the children run (the better of the two). ``x floor`` = seconds per step / floor seconds: how far from the device's
matmul rate a step runs.

``--sweep`` runs grpo-lens alone (lens off, and lens every step) for R in {4, 8, 16} x max_new_tokens in {24, 128}
and prints seconds per step, seconds per completion token and the lens's cost relative to the update's backward
(``lens s``: the lens's own time, its analysis only when it reads the sketch off the update; the last column: the
whole extra time of a lens step, the capture inside the update and the S4 snapshots included).

    python benchmarks/bench_step.py                       # the table (defaults: B=4, R=8, 24 tokens, 6 steps)
    python benchmarks/bench_step.py --steps 3 --warmup 1 --rounds 2      # shorter, each system twice (ABCD DCBA)
    python benchmarks/bench_step.py --steps 3 --warmup 1 --systems plain lens-off
    python benchmarks/bench_step.py --steps 3 --warmup 1 --rounds 2 --systems lens-off lens-floor lens-1
    python benchmarks/bench_step.py --sweep --sweep-prompts 1 --steps 2 --warmup 1
    python benchmarks/bench_step.py --model tiny --steps 2 --warmup 0      # a smoke run in seconds
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
from pathlib import Path

import torch
from common import gemm_flops_per_s, generation_flops, shape_of, shared_prompt_flops, step_flops

SYSTEMS = ("plain", "plain-naive", "lens-off", "lens-1", "lens-1-own", "lens-floor", "trl")

#: OpenMP wait policy of every child (the one import grpo_lens sets; benchmarks/bench_threads.py)
WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


# ---------------------------------------------------------------------------------------------------------------------
# Instrumentation shared by every system
# ---------------------------------------------------------------------------------------------------------------------
class StepClock:
    """Accumulates seconds inside generate / model forward / autograd backward, per step.

    ``mark()`` starts a new step; ``steps`` holds one dict per step with ``gen``, ``fwd``, ``bwd`` seconds.
    """

    def __init__(self, device: str):
        self.device = device
        self.steps: list[dict[str, float]] = []
        self.in_generate = False
        self.suspended = False  # the lens's own passes are not the update's
        self._fwd_depth = 0
        self._t_fwd = 0.0
        self.tokens: list[float] = []  # completion tokens per step, where the system reports them
        self.shapes: list[tuple[int, int, int]] = []  # (N, padded Lp, padded T) per step, where the system reports them

    def mark(self) -> None:
        self.steps.append({"gen": 0.0, "fwd": 0.0, "bwd": 0.0})

    def add(self, key: str, seconds: float) -> None:
        if self.steps and not self.suspended:
            self.steps[-1][key] += seconds

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def attach(self, model: torch.nn.Module, mark_on_generate: bool = False) -> None:
        """Time ``model.generate`` and ``model.forward`` (outside generate); patch ``torch.autograd.backward``."""
        clock = self
        original_generate = model.generate

        def generate(*args, **kwargs):
            if mark_on_generate:
                clock.mark()
            clock.sync()
            t0 = time.perf_counter()
            clock.in_generate = True
            try:
                return original_generate(*args, **kwargs)
            finally:
                clock.in_generate = False
                clock.sync()
                clock.add("gen", time.perf_counter() - t0)

        model.generate = generate

        def pre(module, args):
            if not clock.in_generate:
                if clock._fwd_depth == 0:
                    clock.sync()
                    clock._t_fwd = time.perf_counter()
                clock._fwd_depth += 1

        def post(module, args, output):
            if not clock.in_generate:
                clock._fwd_depth -= 1
                if clock._fwd_depth == 0:
                    clock.sync()
                    clock.add("fwd", time.perf_counter() - clock._t_fwd)

        model.register_forward_pre_hook(pre)
        model.register_forward_hook(post)
        if not getattr(torch.autograd.backward, "_bench_timed", False):
            original_backward = torch.autograd.backward

            def backward(*args, **kwargs):
                clock.sync()
                t0 = time.perf_counter()
                try:
                    return original_backward(*args, **kwargs)
                finally:
                    clock.sync()
                    clock.add("bwd", time.perf_counter() - t0)

            backward._bench_timed = True
            torch.autograd.backward = backward


def peak_memory_mib(device: str) -> float:
    """CUDA: peak allocated tensor memory; CPU: the process's peak resident set size (model included)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def step_prompts(args, step: int) -> list:
    """The B examples of step ``step`` (1-based), exactly as grpo-lens' trainer draws them."""
    from grpo_lens.tasks import get_task
    from grpo_lens.train.loop import step_seed

    return get_task("arithmetic").sample(args.prompts, seed=step_seed(args.seed, step))


# ---------------------------------------------------------------------------------------------------------------------
# The reference: a plain GRPO loop with PyTorch + transformers only
# ---------------------------------------------------------------------------------------------------------------------
def plain_loop(args, clock: StepClock, naive: bool = False) -> tuple[list[float], dict[str, int]]:
    """A plain GRPO loop: generate, rewards, group-normalised advantages, ONE forward + backward, AdamW.

    Written as a careful user would without a library: logits only at the T + 1 last positions
    (``logits_to_keep``; ``naive``: at every position, as a first loop computes them), the sampled tokens' log-probs
    from ``log_softmax(logits / temperature)``, on-policy ratio ``exp(logp - logp.detach())`` (mu = 1), the sequence
    mean of token means as the loss, gradient clipping at ``max_grad_norm``. Returns the wall seconds of each step
    and the model's :func:`common.shape_of`; records each step's (N, padded prompt length, padded completion length)
    in ``clock.shapes``.
    """
    from grpo_lens.models import load_model
    from grpo_lens.rewards import correctness

    model, tok = load_model(args.model, dtype=torch.float32, device=args.device)
    clock.attach(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    eos = [tok.eos_token_id] + [
        i
        for i in (
            [model.generation_config.eos_token_id]
            if isinstance(model.generation_config.eos_token_id, int)
            else (model.generation_config.eos_token_id or [])
        )
        if i != tok.eos_token_id
    ]
    R, T = args.group_size, args.max_new_tokens
    times = []
    for step in range(1, args.steps + 1):
        clock.mark()
        t0 = time.perf_counter()
        examples = step_prompts(args, step)
        texts = [tok.apply_chat_template(e.prompt, tokenize=False, add_generation_prompt=True) for e in examples]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
        ids, att = enc.input_ids.repeat_interleave(R, 0), enc.attention_mask.repeat_interleave(R, 0)
        torch.manual_seed(args.seed + step)
        with torch.no_grad(), autocast(args):
            out = model.generate(
                input_ids=ids,
                attention_mask=att,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=T,
                pad_token_id=tok.pad_token_id,
                eos_token_id=eos,
            )
        comp = out[:, ids.shape[1] :]  # [N, t]
        is_eos = torch.isin(comp, torch.tensor(eos, device=comp.device))
        mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # up to and including the first EOS
        texts_out = tok.batch_decode([c[m].tolist() for c, m in zip(comp, mask)], skip_special_tokens=True)
        answers = [e.columns()["answer"] for e in examples for _ in range(R)]
        rewards = torch.tensor(correctness(None, texts_out, answer=answers), dtype=torch.float32).view(-1, R)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        adv = adv.to(args.device)

        full = torch.cat([ids, comp], 1)
        full_mask = torch.cat([att, mask.long()], 1)
        pos = (full_mask.cumsum(1) - 1).clamp(min=0)
        clock.shapes.append((full.shape[0], ids.shape[1], comp.shape[1]))
        with autocast(args):
            if naive:  # logits at all Lp + t positions, then the t that predict completion tokens
                logits = model(input_ids=full, attention_mask=full_mask, position_ids=pos).logits
                logits = logits[:, ids.shape[1] - 1 : -1]
            else:  # logits at the t + 1 last positions only; the last one predicts nothing
                logits = model(
                    input_ids=full, attention_mask=full_mask, position_ids=pos, logits_to_keep=comp.shape[1] + 1
                ).logits[:, :-1]
        logits = logits.float() / args.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)  # [N, t]
        ratio = torch.exp(logp - logp.detach())
        m = mask.float()
        clock.tokens.append(float(m.sum()))
        loss = (-(ratio * adv[:, None]) * m).sum(1).div(m.sum(1).clamp(min=1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.sync()
        times.append(time.perf_counter() - t0)
    return times, shape_of(model)


def autocast(args):
    """bf16 autocast on CUDA when asked (``--dtype bfloat16`` or ``bf16-mixed``); a no-op context otherwise."""
    import contextlib

    if args.device.startswith("cuda") and args.dtype in ("bfloat16", "bf16-mixed"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------------------------
# grpo-lens and TRL
# ---------------------------------------------------------------------------------------------------------------------
def grpo_lens_run(args, clock: StepClock, lens_every: int) -> tuple[list[float], list[float]]:
    """grpo-lens' trainer on the same work; returns (step seconds, lens seconds) per step from its metrics."""
    from grpo_lens import models
    from grpo_lens.config import TrainConfig
    from grpo_lens.train import loop as tr

    original_load = models.load_model

    def load_and_attach(*a, **kw):
        model, tok = original_load(*a, **kw)
        clock.attach(model, mark_on_generate=True)
        return model, tok

    models.load_model = load_and_attach
    tr.load_model = load_and_attach  # the loop's own name for it
    from grpo_lens.lens.trainer_lens import TrainerLens

    original_measure = TrainerLens.measure

    def measure(self, *a, **kw):
        clock.suspended = True
        try:
            return original_measure(self, *a, **kw)
        finally:
            clock.suspended = False

    TrainerLens.measure = measure
    extra = json.loads(args.grpo_lens_options or "{}")
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(
            model=args.model,
            task="arithmetic",
            group_size=args.group_size,
            prompts_per_step=args.prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            learning_rate=args.lr,
            max_steps=args.steps,
            lens_every=lens_every,
            seed=args.seed,
            out=str(Path(out) / "run"),
            progress=False,
            checkpoint_every=10**6,
            save_final_model=False,
            device=args.device,
            dtype=args.dtype,
            **extra,
        )
        tr.train(config)
        rows = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_seconds" in r]
    clock.tokens = [r["completions/mean_length"] * args.prompts * args.group_size for r in rows]
    return [r["perf/step_seconds"] for r in rows], [r.get("perf/lens_seconds", 0.0) for r in rows]


def trl_run(args, clock: StepClock) -> list[float]:
    """TRL's GRPOTrainer (gradient checkpointing off) on the same prompts, model and settings."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_lens.models import load_model
    from grpo_lens.rewards import correctness

    model, tok = load_model(args.model, dtype=torch.float32, device=args.device)
    clock.attach(model)
    rows = [
        {"prompt": e.prompt, "answer": e.columns()["answer"]}
        for step in range(1, args.steps + 1)
        for e in step_prompts(args, step)
    ]

    def reward(prompts, completions, answer, **kwargs):
        return correctness(prompts, completions, answer=answer)

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            clock.mark()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            clock.sync()
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts * args.group_size,
            num_generations=args.group_size,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            learning_rate=args.lr,
            adam_beta1=0.9,
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            beta=0.0,
            loss_type="grpo",
            num_iterations=1,
            gradient_accumulation_steps=1,
            max_steps=args.steps,
            gradient_checkpointing=False,
            bf16=args.device.startswith("cuda") and args.dtype != "float32",
            use_cpu=not args.device.startswith("cuda"),
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            shuffle_dataset=False,
            seed=args.seed,
            dataloader_num_workers=0,
            log_completions=False,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=cfg,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[Clock()],
        )
        trainer.train()
    return times


def worker(args) -> None:
    """One system in this process; writes its per-step numbers as JSON to ``args.result``."""
    torch.set_num_threads(args.threads)
    clock = StepClock(args.device)
    lens = [0.0] * args.steps
    shape = None
    if args.worker in ("plain", "plain-naive"):
        times, shape = plain_loop(args, clock, naive=args.worker == "plain-naive")
    elif args.worker == "lens-off":
        times, lens = grpo_lens_run(args, clock, lens_every=0)
    elif args.worker == "lens-1":
        times, lens = grpo_lens_run(args, clock, lens_every=1)
    elif args.worker == "lens-1-own":
        args.grpo_lens_options = json.dumps({**json.loads(args.grpo_lens_options or "{}"), "lens_from_update": False})
        times, lens = grpo_lens_run(args, clock, lens_every=1)
    elif args.worker == "lens-floor":
        options = {**json.loads(args.grpo_lens_options or "{}"), "shared_prompt_forward": False}
        args.grpo_lens_options = json.dumps(options)
        times, lens = grpo_lens_run(args, clock, lens_every=0)
    elif args.worker == "trl":
        times = trl_run(args, clock)
    else:
        raise SystemExit(f"unknown system {args.worker!r}; valid: {', '.join(SYSTEMS)}")
    Path(args.result).write_text(
        json.dumps(
            {
                "system": args.worker,
                "step_seconds": times,
                "lens_seconds": lens,
                "split": clock.steps[: len(times)],
                "peak_mib": peak_memory_mib(args.device),
                "tokens_per_step": clock.tokens,
                "shapes": clock.shapes,
                "model_shape": shape,
            }
        )
    )


# ---------------------------------------------------------------------------------------------------------------------
# The parent: run the children, print the tables
# ---------------------------------------------------------------------------------------------------------------------
def run_child(args, system: str, **overrides) -> dict | None:
    """Run one system in a child process; None (with the reason on stderr) when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        values = {**vars(args), **overrides}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--result", str(result)]
        for key in (
            "model",
            "prompts",
            "group_size",
            "max_new_tokens",
            "temperature",
            "steps",
            "seed",
            "lr",
            "threads",
            "device",
            "dtype",
            "grpo_lens_options",
        ):
            if values.get(key) is not None:
                cmd += ["--" + key.replace("_", "-"), str(values[key])]
        t0 = time.perf_counter()
        # every system's child waits the same way (import grpo_lens would set PASSIVE in its own children only)
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": WAIT_POLICY})
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            print(f"[{system}] failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
            return None
        data = json.loads(result.read_text())
        data["wall"] = time.perf_counter() - t0
        data["load"] = os.getloadavg()[0]
        print(
            f"[{system}] done in {data['wall']:.0f} s (load {data['load']:.1f}); s/step {data['step_seconds']}, "
            f"lens s {data['lens_seconds']}, split {data['split']}",
            file=sys.stderr,
            flush=True,
        )
        return data


def merge_runs(parts: list[dict], warmup: int) -> dict:
    """One system's runs (rounds) as one: each run's measured steps (after ``warmup``) side by side, peak = max."""
    keep = lambda xs: xs[warmup:] if len(xs) > warmup else xs  # noqa: E731
    return {
        "step_seconds": [x for p in parts for x in keep(p["step_seconds"])],
        "lens_seconds": [x for p in parts for x in keep(p["lens_seconds"])],
        "split": [x for p in parts for x in keep(p["split"])],
        "peak_mib": max(p["peak_mib"] for p in parts),
    }


def summarize(data: dict, warmup: int) -> dict:
    """Medians over the measured steps (after ``warmup``)."""

    def med(xs):
        xs = xs[warmup:] if len(xs) > warmup else xs
        return statistics.median(xs) if xs else float("nan")

    split = data["split"]
    return {
        "step": med(data["step_seconds"]),
        "gen": med([s["gen"] for s in split]),
        "fwd": med([s["fwd"] for s in split]),
        "bwd": med([s["bwd"] for s in split]),
        "lens": med(data["lens_seconds"]),
        "peak": data["peak_mib"],
        "n": max(len(data["step_seconds"]) - warmup, 1),
    }


LABELS = {
    "plain": "plain PyTorch + transformers loop (logits_to_keep)",
    "plain-naive": "plain loop, logits at every position",
    "lens-off": "grpo-lens train, lens off",
    "lens-1": "grpo-lens train, lens every step",
    "lens-1-own": "grpo-lens train, lens every step, own pass",
    "lens-floor": "grpo-lens train, lens off, every rollout its own prompt",
    "trl": "TRL GRPOTrainer, grad. checkpointing off",
}


def floor_flops(parts: list[dict], warmup: int, groups: int | None = None) -> float | None:
    """Median FLOPs per measured step of a plain loop's runs: sampling + forward/backward of each step's padded
    shapes (benchmarks/common.py), None without a plain run. ``groups`` = B: each distinct prompt once in the prefill
    and the training forward (:func:`common.shared_prompt_flops`, what grpo-lens runs on a step without the lens)."""
    flops = [
        shared_prompt_flops(p["model_shape"], n, groups, lp, t)
        if groups
        else generation_flops(p["model_shape"], n, lp, t) + step_flops(p["model_shape"], n, lp, t)
        for p in parts
        for n, lp, t in (p["shapes"][warmup:] if len(p["shapes"]) > warmup else p["shapes"])
    ]
    return statistics.median(flops) if flops else None


def gemm_rate(args) -> float:
    """Square-GEMM FLOP/s on the benchmark's device with its thread count (bf16 on a GPU for bf16 dtypes)."""
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype in ("bfloat16", "bf16-mixed") and args.device != "cpu" else torch.float32
    return gemm_flops_per_s(2048 if args.device == "cpu" else 8192, device=args.device, dtype=dtype)


def table(args) -> None:
    import importlib.util

    systems = list(args.systems)
    if "trl" in systems and importlib.util.find_spec("trl") is None:
        print("trl is not importable: skipping TRL (pip install -e '.[trl]')", file=sys.stderr)
        systems.remove("trl")
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    load_before = os.getloadavg()
    rate_before = gemm_rate(args)
    for k in range(args.rounds):  # ABCD, DCBA, ...: load from other processes that drifts hits every system alike
        for system in systems if k % 2 == 0 else systems[::-1]:
            data = run_child(args, system)
            if data is not None:
                runs[system].append(data)
    rate = max(rate_before, gemm_rate(args))
    load_after = os.getloadavg()
    loads = [p["load"] for parts in runs.values() for p in parts]
    results = {system: summarize(merge_runs(parts, args.warmup), 0) for system, parts in runs.items() if parts}
    base = results.get("plain", {}).get("step")
    naive = results.get("plain-naive", {}).get("step")
    flops = floor_flops(runs.get("plain") or runs.get("plain-naive") or [], args.warmup)
    floor = flops / rate if flops else None
    shared_flops = floor_flops(runs.get("plain") or runs.get("plain-naive") or [], args.warmup, args.prompts)
    shared_floor = shared_flops / rate if shared_flops else None
    print(
        f"\n{args.model}, {args.device} {args.dtype}, {args.threads} threads (OMP_WAIT_POLICY={WAIT_POLICY}), "
        f"B={args.prompts} prompts x "
        f"R={args.group_size}, max_new_tokens={args.max_new_tokens}, T={args.temperature}; median over steps "
        f"{args.warmup + 1}-{args.steps} of {args.rounds} run(s) per system, in alternating order; load (1-min "
        f"average) {load_before[0]:.1f} at the start, {min(loads or [0]):.1f}-{max(loads or [0]):.1f} at the "
        f"children's ends, {load_after[0]:.1f} at the end\n"
    )
    print("| system | s/step | generate | forward | backward | lens | peak MiB | vs plain | vs naive | x floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for system, s in results.items():
        ratio = f"{s['step'] / base:.2f}" if base else "n/a"
        ratio_naive = f"{s['step'] / naive:.2f}" if naive else "n/a"
        over = f"{s['step'] / floor:.1f}" if floor else "n/a"
        print(
            f"| {LABELS[system]} | {s['step']:.2f} | {s['gen']:.2f} | {s['fwd']:.2f} | {s['bwd']:.2f} | "
            f"{s['lens']:.2f} | {s['peak']:.0f} | {ratio} | {ratio_naive} | {over} |"
        )
    if floor:
        print(
            f"\nFLOP floor: {flops / 1e9:.1f} GFLOP per step (the plain loop's padded shapes: sampling with a KV "
            f"cache + forward/backward, benchmarks/common.py) / {rate / 1e9:.0f} GFLOP/s (square GEMM, "
            f"{args.threads} threads, best of before/after) = {floor:.2f} s; with each of the B prompts once in the "
            f"prefill and the training forward (what a grpo-lens step without the lens runs): "
            f"{shared_flops / 1e9:.1f} GFLOP = {shared_floor:.2f} s"
        )
    if base and "lens-off" in results and "lens-1" in results:
        off, on = results["lens-off"]["step"], results["lens-1"]["step"]
        print(
            f"\nlens every 5 steps (the default), from the two rows above: (4 x {off:.2f} + {on:.2f}) / 5 = "
            f"{(4 * off + on) / 5:.2f} s/step, {(4 * off + on) / 5 / base:.2f}x plain"
        )
    if "lens-off" in results:
        off = results["lens-off"]["step"]
        for system in ("lens-1", "lens-1-own"):
            if system in results:
                print(
                    f"\n{LABELS[system]} / lens off: {results[system]['step'] / off:.2f}x (target for lens-1: <= 1.15x)"
                )
        if "lens-floor" in results:
            own = results["lens-floor"]["step"]
            line = f"a lens step's floor (every rollout its own prompt, the lens free) / lens off: {own / off:.2f}x"
            if "lens-1" in results:
                line += f"; lens every step / that floor: {results['lens-1']['step'] / own:.2f}x (the lens's own cost)"
            print(line)
        if floor:
            print(
                f"lens off / its FLOP floor: {off / floor:.2f}x the plain loop's, {off / shared_floor:.2f}x with each "
                f"prompt once (target <= 1.5x); generate "
                f"{results['lens-off']['gen']:.2f} s, forward {results['lens-off']['fwd']:.2f} s, backward "
                f"{results['lens-off']['bwd']:.2f} s, the rest (rewards, AdamW, bookkeeping) "
                f"{off - results['lens-off']['gen'] - results['lens-off']['fwd'] - results['lens-off']['bwd']:.2f} s"
            )
    if "trl" in results and "lens-off" in results:
        print(f"\nTRL / grpo-lens (lens off): {results['trl']['step'] / results['lens-off']['step']:.2f}")
    if base and "lens-off" in results:
        print(
            "targets (set against the naive loop, 'vs naive'): lens off <= 0.95x, lens every step <= 1.15x, peak "
            "memory <= the loop's, TRL / grpo-lens >= 1.6"
        )


def sweep(args) -> None:
    """grpo-lens alone for R x max_new_tokens, lens off and every step."""
    print(
        f"\n{args.model}, {args.device} {args.dtype}, {args.threads} threads (OMP_WAIT_POLICY={WAIT_POLICY}), "
        f"B={args.sweep_prompts} prompts; median "
        f"over steps {args.warmup + 1}-{args.steps}\n"
    )
    print(
        "| R | max_new_tokens | tokens/step | train s/step | train ms/token | lens-every-step s/step | lens s | "
        "lens / update backward | (lens-every-step - train) / update backward |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for R in args.sweep_group_sizes:
        for T in args.sweep_tokens:
            off = run_child(
                args,
                "lens-off",
                group_size=R,
                max_new_tokens=T,
                prompts=args.sweep_prompts,
                grpo_lens_options=json.dumps({"log_completions": 0}),
            )
            on = run_child(args, "lens-1", group_size=R, max_new_tokens=T, prompts=args.sweep_prompts)
            if off is None or on is None:
                continue
            so, sn = summarize(off, args.warmup), summarize(on, args.warmup)
            tokens = statistics.median(off["tokens_per_step"][args.warmup :] or off["tokens_per_step"])
            print(
                f"| {R} | {T} | {tokens:.0f} | {so['step']:.2f} | {1000 * so['step'] / max(tokens, 1):.1f} | "
                f"{sn['step']:.2f} | {sn['lens']:.2f} | {sn['lens'] / max(so['bwd'], 1e-9):.2f} | "
                f"{(sn['step'] - so['step']) / max(so['bwd'], 1e-9):.2f} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4, help="B prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="R completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--steps", type=int, default=6, help="steps per system (the first --warmup are not counted)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="runs per system, in alternating order (ABCD DCBA ...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "bf16-mixed"),
        help="bfloat16: bf16 weights in grpo-lens, bf16 autocast in the plain loops; bf16-mixed: float32 "
        "weights and bf16 autocast in every system (the GPU setting)",
    )
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--sweep", action="store_true", help="grpo-lens alone over R x max_new_tokens instead")
    ap.add_argument("--sweep-group-sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=[24, 128])
    ap.add_argument("--sweep-prompts", type=int, default=2, help="B prompts per step in the sweep")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--grpo-lens-options", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    elif args.sweep:
        sweep(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
