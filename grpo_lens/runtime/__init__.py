"""Runtime concerns the trainer (:mod:`grpo_lens.train`), the lens (:mod:`grpo_lens.lens`) and the probe
(:mod:`grpo_lens.probe`) share: processes, sharding and memory. Nothing here imports any of them.

processes         several processes (torchrun / accelerate): sums and gathers
sharding          --parallelism: the policy replicated (ddp) or sharded with FSDP2 (fsdp2), full-state checkpoints
memory            micro-batch sizing from the model's activation memory, the allocator's freed-memory policy
"""
