"""``transformers.Trainer`` with megatron-fsdp (issue 30): ``MegatronFSDPTrainer`` against
Trainer's own DDP run on the same data and seed, 2 ranks.

Each case trains a tiny Llama 10 optimizer steps (gradient accumulation 2, clipping at 0.5
with the norm above it, a cosine schedule; some cases with bf16 autocast or Trainer's
``gradient_checkpointing``) with Trainer's DDP and with ours in the same world; every step's
logged loss and gradient norm must agree to 1e-5 relative, and so must ``evaluate()``'s loss
after training. Resuming from ``checkpoint-5`` must continue the uninterrupted curve (a load
that does nothing fails: the weights at step 5 are not the initial ones); ``save_model()``'s
directory must load with ``from_pretrained`` and give the sharded model's logits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_cases import PROBE, Tokens, llama

from mfsdp_collectives.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 10


def _arguments(out: str, bf16: bool, recompute: bool) -> Any:
    """Trainer's options; ``recompute``: Trainer's ``gradient_checkpointing`` (the units'
    weights are gathered again for the recomputed forward)."""
    return transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
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
        gradient_checkpointing=recompute,
    )


class _Log(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.steps.append((float(logs["loss"]), float(logs["grad_norm"])))


def _train(
    trainer_class: Any,
    out: str,
    precision: tuple[bool, bool],
    resume: str | None = None,
    **kwargs: Any,
) -> tuple[Any, list[tuple[float, float]], float]:
    """(the trainer, each step's (loss, grad norm), the loss of ``evaluate()``);
    ``precision``: (bf16 autocast, recompute)."""
    log = _Log()
    kwargs.setdefault("model", llama())
    trainer = trainer_class(
        args=_arguments(out, *precision),
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


def _ddp_and_ours(
    rank: int, world: int, out: str, api: str, zero: int, bf16: bool, recompute: bool
) -> Any:
    from megatron_fsdp.integrations.transformers import MegatronFSDPTrainer

    precision = (bf16, recompute)
    _, ddp_steps, ddp_eval = _train(transformers.Trainer, f"{out}/ddp", precision)
    ours = f"{out}/ours"
    trainer, steps, eval_loss = _train(MegatronFSDPTrainer, ours, precision, **_ours(api, zero))
    assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    export = _export_difference(trainer, f"{out}/export", compare_logits=not bf16)
    resume = f"{ours}/checkpoint-5"
    _, resumed, _ = _train(MegatronFSDPTrainer, ours, precision, resume, **_ours(api, zero))
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


FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
# (entry point, ZeRO level, bf16 autocast, recompute). CI runs the first four (each API family
# once, both ZeRO levels, bf16, recompute); MFSDP_FULL_MATRIX=1 (nox -s tests_full) all.
CASES = [
    ("seed", 3, False, False),
    ("seed", 1, True, False),
    ("per_module", 3, False, True),
    ("fully_shard", 3, False, False),
    ("seed", 1, False, False),
    ("seed", 3, True, False),
    ("seed", 3, False, True),
    ("per_module", 1, True, False),
    ("fully_shard_model", 1, False, False),
    ("class", 3, False, False),
]
CI_CASES = 4


def _cases() -> list[Any]:
    marks = [pytest.mark.skip(reason="full matrix only: MFSDP_FULL_MATRIX=1")]
    return [
        pytest.param(*case, marks=() if FULL or index < CI_CASES else marks)
        for index, case in enumerate(CASES)
    ]


@pytest.mark.parametrize(("api", "zero", "bf16", "recompute"), _cases())
def test_trainer_matches_trainers_ddp_resumes_and_exports(
    api: str, zero: int, bf16: bool, recompute: bool, tmp_path: Path
) -> None:
    out = str(tmp_path)
    results = run_distributed(_ddp_and_ours, 2, out, api, zero, bf16, recompute, timeout=240)
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


def test_units_come_from_the_config_then_fsdp_config_then_no_split_modules(tmp_path: Path) -> None:
    from megatron_fsdp.integrations.transformers import MegatronFSDPConfig, unit_classes

    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert unit_classes(llama(), MegatronFSDPConfig(), plain) == [layer]  # _no_split_modules
    named = MegatronFSDPConfig(fsdp_unit_modules=["torch.nn.Linear"])
    assert unit_classes(llama(), named, plain) == ["torch.nn.Linear"]
    with_config = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaRMSNorm"]},
    )
    rms_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm
    assert unit_classes(llama(), MegatronFSDPConfig(), with_config) == [rms_norm]
    with pytest.raises(ValueError, match=r"fsdp_unit_modules: .*names no blocks"):
        unit_classes(torch.nn.Sequential(torch.nn.Linear(2, 2)), MegatronFSDPConfig(), plain)
    with pytest.raises(ValueError, match="no module of LlamaForCausalLM is a GPT2Block"):
        unit_classes(llama(), MegatronFSDPConfig(), _fsdp_config_naming("GPT2Block", tmp_path))


def _fsdp_config_naming(name: str, tmp_path: Path) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        fsdp_config={"transformer_layer_cls_to_wrap": [name]},
    )


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"fsdp": "full_shard"}, ValueError, "TrainingArguments.fsdp="),
    ],
)
def test_options_it_does_not_take_are_refused_naming_them(
    arguments: dict[str, Any], error: type[Exception], match: str, tmp_path: Path
) -> None:
    from megatron_fsdp.integrations.transformers import MegatronFSDPTrainer

    try:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], **arguments
        )
    except ValueError as refused_by_transformers:  # an invalid combination there already
        pytest.skip(f"transformers refuses it itself: {refused_by_transformers}")
    with pytest.raises(error, match=match):
        MegatronFSDPTrainer(model=llama(), args=args)


def _best_model(rank: int, world: int, out: str, save_only_model: bool) -> tuple[float, ...]:
    """``load_best_model_at_end`` with "best" meaning the highest eval loss, so the best
    checkpoint is step 5's, not the last: after train() the model must be step 5's again."""
    from megatron_fsdp.integrations.transformers import MegatronFSDPTrainer

    args = _arguments(out, bf16=False, recompute=False)
    args.eval_strategy = args.save_strategy = "steps"
    args.eval_steps = 5
    args.load_best_model_at_end, args.save_only_model = True, save_only_model
    args.metric_for_best_model, args.greater_is_better = "eval_loss", True
    trainer = MegatronFSDPTrainer(
        model=llama(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(16, seed=1)
    )
    trainer.train()
    logged = [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log]
    assert trainer.state.best_model_checkpoint == f"{out}/checkpoint-5"
    return logged[0], logged[1], trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("save_only_model", [False, True])
def test_load_best_model_at_end_brings_back_the_best_checkpoint(
    save_only_model: bool, tmp_path: Path
) -> None:
    at_5, at_10, after = run_distributed(
        _best_model, 2, str(tmp_path), save_only_model, timeout=120
    )[0]
    assert at_5 > at_10  # it learned: step 5 is "best" only by this metric
    assert after == pytest.approx(at_5, rel=1e-6)


def _lora(model: Any) -> Any:
    """peft LoRA on the attention projections: every decoder layer (a unit) then holds
    frozen base weights beside its trainable adapters."""
    import peft

    torch.manual_seed(1)  # the adapters draw alike in both runs
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def _lora_ddp_and_ours(rank: int, world: int, out: str, api: str) -> Any:
    from megatron_fsdp.integrations.transformers import MegatronFSDPConfig, MegatronFSDPTrainer

    plain = (False, False)
    _, ddp_steps, ddp_eval = _train(transformers.Trainer, f"{out}/ddp", plain, model=_lora(llama()))
    config = MegatronFSDPConfig(api=api, zero_dp_strategy=3)  # type: ignore[arg-type]
    trainer, steps, eval_loss = _train(
        MegatronFSDPTrainer, f"{out}/ours", plain, model=_lora(llama()), megatron_fsdp=config
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return ddp_steps, ddp_eval, steps, eval_loss, trainable


@pytest.mark.parametrize("api", ["seed", "per_module"])
def test_lora_trains_at_zero3_as_trainers_ddp(api: str, tmp_path: Path) -> None:
    """Issue 48: the frozen base weights were freed once the adapters' gradients landed,
    while autograd still read them for the input gradient (backward raised)."""
    results = run_distributed(_lora_ddp_and_ours, 2, str(tmp_path), api, timeout=240)
    ddp_steps, ddp_eval, steps, eval_loss, trainable = results[0]
    assert 0 < trainable < sum(p.numel() for p in llama().parameters()) // 10
    assert len(steps) == len(ddp_steps) == STEPS
    torch.testing.assert_close(torch.tensor(steps), torch.tensor(ddp_steps), rtol=1e-5, atol=0)
    assert eval_loss == pytest.approx(ddp_eval, rel=1e-5)
