"""``transformers.Trainer`` with megatron-fsdp (issue 30): ``MegatronFSDPTrainer`` against
Trainer's own DDP run on the same data and seed, 2 ranks.

Each case trains a tiny Llama 10 optimizer steps (gradient accumulation 2, clipping at 0.5
with the norm above it, a cosine schedule) with Trainer's DDP and with ours in the same
world; every step's logged loss and gradient norm must agree to 1e-5 relative, and so must
``evaluate()``'s loss after training. Resuming from ``checkpoint-5`` must continue the
uninterrupted curve (a load that does nothing fails: the weights at step 5 are not the
initial ones); ``save_model()``'s directory must load with ``from_pretrained`` and give the
sharded model's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_cases import PROBE, Tokens, llama

from mfsdp_collectives.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 10


def _arguments(out: str, bf16: bool, steps: int = STEPS) -> Any:
    return transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        max_grad_norm=0.5,
        logging_steps=1,
        save_steps=5,
        use_cpu=True,
        bf16=bf16,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )


class _Log(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.steps.append((float(logs["loss"]), float(logs["grad_norm"])))


def _train(
    trainer_class: Any, out: str, bf16: bool, resume: str | None = None, **kwargs: Any
) -> tuple[Any, list[tuple[float, float]], float]:
    log = _Log()
    kwargs.setdefault("model", llama())
    trainer = trainer_class(
        args=_arguments(out, bf16),
        train_dataset=Tokens(),
        eval_dataset=Tokens(sequences=16, seed=1),
        callbacks=[log],
        **kwargs,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, log.steps, float(trainer.evaluate()["eval_loss"])


def _ours(api: str, zero: int) -> dict[str, Any]:
    """Trainer arguments for each entry point: the trainer shards (``seed``, ``per_module``)
    or the user did (the seed one-liner with its optimizer, ``fully_shard_model``, the
    reference's class)."""
    from megatron_fsdp import FSDPDistributedIndex, MegatronFSDP, fully_shard, fully_shard_model
    from megatron_fsdp.integrations.transformers import MegatronFSDPConfig

    if api in ("seed", "per_module"):
        config = MegatronFSDPConfig(api=api, zero_dp_strategy=zero)  # type: ignore[arg-type]
        return {"megatron_fsdp": config}
    model = llama()
    units = [transformers.models.llama.modeling_llama.LlamaDecoderLayer]
    if api == "fully_shard":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        wrapper, optimizer = fully_shard(model, optimizer, units, zero_dp_strategy=zero)
        return {"model": wrapper, "optimizers": (optimizer, None)}
    if api == "fully_shard_model":
        return {"model": fully_shard_model(model, units, zero_dp_strategy=zero)}
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    return {"model": MegatronFSDP(model, index, fsdp_unit_modules=units)}


def _ddp_and_ours(rank: int, world: int, out: str, api: str, zero: int, bf16: bool) -> Any:
    from megatron_fsdp.integrations.transformers import MegatronFSDPTrainer

    _, ddp_steps, ddp_eval = _train(transformers.Trainer, f"{out}/ddp", bf16)
    ours = f"{out}/ours"
    trainer, steps, eval_loss = _train(MegatronFSDPTrainer, ours, bf16, **_ours(api, zero))
    assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    export = _export_difference(trainer, f"{out}/export", compare_logits=not bf16)
    resume = f"{ours}/checkpoint-5"
    _, resumed, _ = _train(MegatronFSDPTrainer, ours, bf16, resume, **_ours(api, zero))
    return ddp_steps, ddp_eval, steps, eval_loss, resumed, export


def _export_difference(trainer: Any, export: str, compare_logits: bool) -> float:
    """``save_model``, then on rank 0 ``from_pretrained``: the largest difference from the
    sharded model's weights (and, in fp32, its logits; under autocast they differ)."""
    import mfsdp_checkpoint

    trainer.save_model(export)
    full = mfsdp_checkpoint.gather_full_state_dict(trainer.model)
    with torch.no_grad():
        logits = trainer.model(PROBE).logits.float()
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        return 0.0
    reloaded = transformers.LlamaForCausalLM.from_pretrained(export).eval()
    assert reloaded.config.architectures == ["LlamaForCausalLM"]
    state = reloaded.state_dict()
    assert set(state) == set(full)
    worst = max(float((state[k] - v).abs().max()) for k, v in full.items())
    if compare_logits:
        with torch.no_grad():
            worst = max(worst, float((reloaded(PROBE).logits - logits).abs().max()))
    return worst


CASES = [
    ("seed", 3, False),
    ("seed", 1, False),
    ("per_module", 3, False),
    ("seed", 3, True),
    ("fully_shard", 3, False),
    ("fully_shard_model", 1, False),
    ("class", 3, False),
]


@pytest.mark.parametrize(("api", "zero", "bf16"), CASES)
def test_trainer_matches_trainers_ddp_resumes_and_exports(
    api: str, zero: int, bf16: bool, tmp_path: Path
) -> None:
    out = str(tmp_path)
    results = run_distributed(_ddp_and_ours, 2, out, api, zero, bf16, timeout=240)
    ddp_steps, ddp_eval, steps, eval_loss, resumed, export_difference = results[0]
    assert len(ddp_steps) == len(steps) == STEPS
    losses = [loss for loss, _ in steps]
    assert losses[-1] < losses[0] - 0.05, losses  # it learns: the comparison means something
    assert min(norm for _, norm in ddp_steps) > 0.5  # the clipping is on at every step
    torch.testing.assert_close(torch.tensor(steps), torch.tensor(ddp_steps), rtol=1e-5, atol=0)
    assert eval_loss == pytest.approx(ddp_eval, rel=1e-5)
    # Resumed at step 5, the next five steps continue the uninterrupted curve.
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(steps[5:]), rtol=1e-5, atol=0)
    assert {"config.json", "model.safetensors"} <= {p.name for p in Path(out, "export").iterdir()}
    assert export_difference < 1e-5
    assert Path(out, "ours", "checkpoint-5", "megatron_fsdp", "mfsdp_checkpoint.json").is_file()
