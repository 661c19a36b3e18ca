"""CI's cross-section of the slow parametrised tests.

CI (``bash .ci/run``) has 25 minutes on 2 cores; ``MFSDP_FULL_MATRIX=1`` (``nox -s
tests_full``, run before an issue is resolved) runs everything. Most files pick their own
cross-section (the parity matrix's ``CI_CELLS``, ``_FULL_ONLY`` marks); the cases below are
the further variants CI leaves to the full run: each has a sibling in CI that exercises the
same code through another entry point, schedule or world size.
"""

from __future__ import annotations

import os

import pytest

FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"

_MEGATRON = "packages/megatron-fsdp/tests/"
FULL_ONLY = frozenset(
    _MEGATRON + case
    for case in (
        # a mesh over part of the world: CI keeps the per-module API's (test_hooks_submesh.py)
        "test_megatron_fsdp_submesh.py::test_seed_api_on_a_submesh_uses_only_its_groups",
        # generate() and save_pretrained: CI keeps the seed API's (per_module's for export)
        "test_megatron_fsdp_generate.py::test_generate_returns_on_ranks_that_stop_at_different_lengths[per_module]",
        "test_megatron_fsdp_generate.py::test_generate_returns_on_ranks_that_stop_at_different_lengths[class]",
        "test_megatron_fsdp_generate.py::test_generate_returns_on_ranks_that_stop_at_different_lengths[fully_shard_model]",
        "test_megatron_fsdp_generate.py::test_save_pretrained_writes_what_from_pretrained_loads[class]",
        "test_megatron_fsdp_generate.py::test_save_pretrained_writes_what_from_pretrained_loads[seed]",
        "test_megatron_fsdp_generate.py::test_the_export_snippet_writes_what_from_pretrained_loads[seed]",
        # transformers' Trainer: CI keeps one case per entry point family
        "test_megatron_fsdp_hf_trainer.py::test_lora_trains_at_zero3_as_trainers_ddp[per_module]",
        "test_megatron_fsdp_hf_trainer.py::test_trainer_matches_trainers_ddp_resumes_and_exports[fully_shard-3-False-False]",
        "test_megatron_fsdp_hf_trainer.py::test_trainer_matches_trainers_ddp_resumes_and_exports[seed-3-False-False]",
        "test_megatron_fsdp_hf_trainer.py::test_load_best_model_at_end_brings_back_the_best_checkpoint[True]",
        # torch.compile over our units: CI keeps per-block per_module and whole-model seed
        "test_megatron_fsdp_compile.py::test_compile_compiles_the_blocks_and_trains_as_eager[per_block-seed]",
        "test_megatron_fsdp_compile.py::test_compile_compiles_the_blocks_and_trains_as_eager[whole_model-per_module]",
        # a lossy gather under ZeRO-2: CI keeps seed, model_optimizer and per_module
        "test_megatron_fsdp_quantized_comms.py::test_a_lossy_gather_leaves_the_weights_the_zero2_optimizer_steps[class]",
        "test_megatron_fsdp_quantized_comms.py::test_a_lossy_gather_leaves_the_weights_the_zero2_optimizer_steps[mcore]",
        # start_param_sync: CI keeps 2 ranks
        "test_megatron_fsdp_class_api.py::test_start_param_sync_may_leave_the_gathers_to_the_forward[optim-4]",
        "test_megatron_fsdp_class_api.py::test_start_param_sync_may_leave_the_gathers_to_the_forward[optim_grads_params-4]",
        # checkpoints under TP and HSDP/HFSDP: CI keeps one of each layout pair
        "test_megatron_fsdp_tp.py::test_an_fsdp_x_tp_checkpoint_resumes_exactly[True-4-False]",
        "test_megatron_fsdp_tp.py::test_an_fsdp_x_tp_checkpoint_resumes_exactly[True-2-False]",
        "test_megatron_fsdp_checkpoint.py::test_a_hybrid_checkpoint_resumes_exactly[hsdp-4-hfsdp]",
        "test_megatron_fsdp_checkpoint.py::test_a_hybrid_checkpoint_resumes_exactly[hsdp-4-hsdp]",
        "test_megatron_fsdp_checkpoint.py::test_a_hybrid_checkpoint_resumes_exactly[hsdp-2-]",
    )
) | frozenset(
    {
        # pipelining beside FSDP2: CI keeps 1f1b per_module and gpipe root_wrapper
        "packages/mfsdp-hooks/tests/test_hooks_pipelining_fsdp2.py::test_same_collectives_and_losses_as_fsdp2_on_the_same_schedule[1f1b-root_wrapper]",
        "packages/mfsdp-hooks/tests/test_hooks_pipelining_fsdp2.py::test_same_collectives_and_losses_as_fsdp2_on_the_same_schedule[gpipe-per_module]",
        # FSDP2's all-reduce hook and force-sum beside quantized reduce-scatters (the comm
        # hooks' own tests keep both in CI)
        "packages/mfsdp-hooks/tests/test_hooks_quantized_comms.py::test_quantized_reduce_scatters_take_the_all_reduce_hook_and_force_sum",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if FULL:
        return
    skip = pytest.mark.skip(reason="CI cross-section: MFSDP_FULL_MATRIX=1 (nox -s tests_full)")
    for item in items:
        if item.nodeid in FULL_ONLY:
            item.add_marker(skip)
