"""What the CPU smoke runs cannot show, checked on the GPU of the machine it runs on.

1. Every example as its smoke run on this node's GPUs (smoke.py --gpus, which
   `nox -s examples -- --gpus` runs): a process per GPU, NCCL, the launcher its job.sh
   uses, and the smoke run's checks.
2. The template with the language model's section (other_model.py) in place of "Your
   model and data", every GPU setting on (bf16, channels_last, cudnn.benchmark, pinned
   memory, torch.compile): it trains, stops on SIGTERM with a checkpoint, and resumes.
3. The template at its defaults, ResNet-50 at 224 px on synthetic images: the log's
   samples/s.

A developer's tool for a GPU node, not part of the test suite (no GPU there).

    python tests/tools/gpu_check.py [--skip-examples]
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The helpers (smoke.py and the rest) sit in tests/helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
import smoke  # noqa: E402
import torch
from other_model import MODEL_ARGS, write_language_model_template  # noqa: E402
from smoke import (  # noqa: E402
    EXAMPLES_DIR,
    ON_GPUS,
    Launch,
    base_env,
    check_run,
    run_example,
)

SEQUENCE_ARGS = (
    *MODEL_ARGS, "--synthetic-data", "--synthetic-size", "6000", "--batch-size", "64",
    "--accumulation-steps", "2", "--epochs", "2", "--warmup-steps", "5",
    "--log-every", "10", "--num-workers", "2", "--bf16", "--channels-last",
    "--cudnn-benchmark", "--pin-memory", "--compile",
)  # fmt: skip


def check_other_model(tmp: Path) -> int:
    folder = write_language_model_template(tmp / "language_model")
    # 600 validation sequences of 16 tokens each
    launch = Launch("srun", args=SEQUENCE_ARGS, val_samples=600 * 16)

    def run(checkpoints: str, **kwargs):
        env = {**ON_GPUS, "CHECKPOINT_DIR": str(tmp / checkpoints)}
        return run_example(
            "generic/template", launch, env=env, folder=folder, timeout=400, **kwargs
        )

    plain = run("plain")
    print("language model, GPU settings on:", plain.line(), check_run(plain))
    print("\n".join(plain.outputs[0].splitlines()[-12:]), flush=True)

    def stop(procs, logs):
        while "epoch 0 step 40 |" not in logs[0].read_text():
            if procs[0].poll() is not None:
                return
            time.sleep(0.1)
        procs[0].send_signal(signal.SIGTERM)

    stopped = run("stopped", while_running=stop)
    saved = "checkpoint saved" in stopped.output
    resumed = run("stopped")
    print("stopped:", stopped.line(), "| checkpoint saved:", saved)
    print("resumed:", resumed.line(), "| resumed:", "Resumed from" in resumed.output)
    problems = check_run(plain) + check_run(resumed)
    if not saved or "Resumed from" not in resumed.output:
        problems.append("no stop and resume")
    if resumed.summaries and plain.summaries:
        a, b = plain.summaries[0], resumed.summaries[0]
        print("uninterrupted:", a)
        print("resumed:      ", b)
        if a["steps"] != b["steps"]:
            problems.append("resumed run took another number of steps")
    print("PROBLEMS:" if problems else "ok", problems, flush=True)
    return len(problems)


def check_template_defaults() -> int:
    command = [
        sys.executable, "main.py", "--synthetic-data", "--max-steps", "150",
        "--log-every", "25", "--warmup-steps", "10",
    ]  # fmt: skip
    env = {**base_env(), **ON_GPUS, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as checkpoints:
        env["CHECKPOINT_DIR"] = checkpoints
        result = subprocess.run(
            command, cwd=EXAMPLES_DIR / "generic" / "template", env=env,
            capture_output=True, text=True, timeout=400,
        )  # fmt: skip
    print("template defaults, ResNet-50 224 px, synthetic:", result.returncode)
    print("\n".join((result.stdout + result.stderr).splitlines()[-14:]), flush=True)
    losses = [float(x) for x in re.findall(r"\| loss ([\d.]+) \|", result.stderr)]
    ok = result.returncode == 0 and losses and all(map(math.isfinite, losses))
    return 0 if ok else 1


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("error: no GPU that torch can use: run this on a GPU node.")
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{torch.cuda.get_device_name(0)}, compute capability "
        f"{torch.cuda.get_device_capability(0)}",
        flush=True,
    )
    failed = 0
    if "--skip-examples" not in sys.argv:
        failed += smoke.main(["--gpus"])
    with tempfile.TemporaryDirectory() as tmp:
        failed += check_other_model(Path(tmp))
    failed += check_template_defaults()
    print("FAILED" if failed else "all passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
