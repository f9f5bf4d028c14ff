"""A process that imports grpo-lens once and then forks one ``grpo-lens`` CLI process per request (tests only).

tests/train/test_crash_resume.py kills the trainer a dozen times. Paying Python's import of torch and transformers
(about 10 s on a busy 2-core machine) for every one of those processes would make the test take minutes, so this zygote
imports everything once, without running any torch computation (no thread pool exists yet, so forking is safe), and
each request forks a fresh child that runs ``grpo_lens.cli.main(argv)`` exactly as ``python -m grpo_lens.cli`` would.
The child is a real process: SIGKILL from ``GRPO_LENS_TEST_KILL_AT`` or from the test kills it and nothing else.

Protocol (JSON lines): stdin ``{"argv": [...], "env": {...}, "log": PATH}``; stdout ``{"ready": true}`` once after the
imports, then per request ``{"pid": PID}`` right after the fork and ``{"pid": PID, "rc": RC}`` when the child ends
(RC = -signal when it was killed by one). The child's stdout and stderr go to ``log``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

#: ``grpo-lens train`` argv of the crash tests and of benchmarks/faults.py: a tiny model, 4 steps of 2 prompts x 4
#: completions, a checkpoint every 2 steps (1 kept), the lens at step 3, 3 logged completions (everything a resume
#: must restore).
RUN_ARGS = [
    "train",
    "--model",
    "tiny",
    "--rewards",
    "test_alternating",
    "--group-size",
    "4",
    "--prompts-per-step",
    "2",
    "--max-new-tokens",
    "4",
    "--max-steps",
    "4",
    "--checkpoint-every",
    "2",
    "--keep-checkpoints",
    "1",
    "--lens-every",
    "3",
    "--learning-rate",
    "0.003",
    "--log-completions",
    "3",
    "--no-progress",
    "--device",
    "cpu",
]


def main() -> None:
    import accelerate  # noqa: F401
    import helpers_rewards  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import grpo_lens.cli  # noqa: F401
    import grpo_lens.lens.trainer_lens  # noqa: F401
    import grpo_lens.models  # noqa: F401
    import grpo_lens.train.loop  # noqa: F401

    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)  # never returns
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        reply({"pid": pid, "rc": rc})


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def run_child(request: dict) -> None:
    """In the forked child: environment, output to the log file, then the CLI; exits with its status."""
    code = 1
    try:
        sys.stdin.close()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(request.get("env", {}))
        from grpo_lens.cli import main as cli_main

        code = cli_main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - report, then exit non-zero
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
