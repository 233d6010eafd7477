"""Suite-wide settings: hypothesis profiles, one torch thread, and the ``slow`` tier.

``python -m pytest -m "not slow"`` is the fast tier for iteration (a few minutes on 2 cores);
CI runs everything. A test is slow when it spawns gloo processes, builds Hugging Face models on
several ranks, runs an external tool over the repository (mypy, mkdocs, a wheel build, notebooks)
or takes more than about 3 s. The lists below are the one place that says which: whole files in
``SLOW_FILES``, single tests of otherwise fast files in ``SLOW_TESTS`` (by function name, so every
parametrization of a test goes with it).
"""

import os
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the suite well inside its time budget on 2 cores; "dev" explores more.
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)  # simulated ranks are tiny tensors; threads only add overhead

# files (relative to the repository root) whose every test is slow
SLOW_FILES = frozenset(
    {
        "tests/test_review_comm.py",
        "tests/test_review_comm_ops.py",
        "tests/test_context_traced.py",
        "tests/test_permute_compiled_gloo.py",
        "tests/test_review_checkpoint_gloo.py",
        "tests/test_benchmarks.py",
        "tests/test_benchmarks_context.py",
        "tests/test_checkpoint.py",
        "tests/test_context_llm_gloo.py",
        "tests/test_dit_checkpoint_gloo.py",
        "tests/test_dit_compose_gloo.py",
        "tests/test_dit_pipeline_families.py",
        "tests/test_distributed.py",
        "tests/test_docs_and_notebooks.py",
        "tests/test_docs_site.py",
        "tests/test_domain_models.py",
        "tests/test_families.py",
        "tests/test_hf_models.py",
        "tests/test_moe_families.py",
        "tests/test_mq.py",
        "tests/test_native.py",
        "tests/test_packaging.py",
        "tests/test_physicsnemo_models.py",
        "tests/test_pipeline_ckpt_gloo.py",
        "tests/test_pipeline_example.py",
        "tests/test_pipeline_gloo.py",
        "tests/test_pipeline_torch.py",
        "tests/test_public_path.py",
        "tests/test_pvary_sites.py",
        "tests/test_reliability.py",
        "tests/test_serve_example.py",
        "tests/test_train_example.py",
        "tests/test_typing.py",
    }
)

# the slow tests of files that are otherwise fast: file -> test function names
SLOW_TESTS: dict[str, frozenset[str]] = {
    "tests/test_review_replicas_moe.py": frozenset(
        {
            "test_moe_block_behind_pvary_refused_on_two_gloo_processes",
            "test_moe_block_behind_pvary_refused_on_simulated_ranks",
        }
    ),
    "tests/test_review_auto_families.py": frozenset(
        {"test_dense_then_experts_on_two_gloo_processes"}
    ),
    "tests/test_gloo_dtypes.py": frozenset({"test_every_dtype_every_movement_op_on_gloo"}),
    "tests/test_object_dtypes.py": frozenset({"test_object_helpers_on_gloo"}),
    "tests/test_review_moe_pipeline.py": frozenset(
        {"test_evaluation_and_a_frozen_first_stage_on_gloo"}
    ),
    "tests/test_review_leftovers.py": frozenset(
        {
            "test_data_parallel_broadcasts_buffers_as_ddp_on_gloo",
            "test_label_smoothing_compiled_fullgraph_equals_one_device",
            "test_label_smoothing_on_gloo",
            "test_load_strict_false_reports_skipped_keys_of_a_pipeline",
            "test_model_forward_with_label_smoothing_equals_one_device",
        }
    ),
    "tests/test_context_rope.py": frozenset({"test_gloo_logits_and_generate_match_one_device"}),
    "tests/test_context_frames.py": frozenset({"test_frames_on_gloo"}),
    "tests/test_review_domain.py": frozenset({"test_on_gloo"}),
    "tests/test_domain_compile.py": frozenset(
        {"test_convs_on_simulated_ranks", "test_models_on_simulated_ranks", "test_models_on_gloo"}
    ),
    "tests/test_grad_scaler.py": frozenset(
        {"test_gloo_tp_shard_overflow_on_one_rank", "test_gloo_dp_engines", "test_gloo_dp2_tp2"}
    ),
    "tests/test_generate_real_sampling.py": frozenset(
        {"test_model_generate_samples_one_devices_tokens_on_every_rank"}
    ),
    "tests/test_review_checkpoint.py": frozenset(
        {
            "test_zero_refuses_plain_state_whose_steps_differ",
            "test_safetensors_save_over_a_sharded_save_pretrained",
        }
    ),
    "tests/test_review_context.py": frozenset(
        {
            "test_gloo_training_forward_equals_one_device_or_raises",
            "test_gloo_ranks_given_different_batches_are_refused",
        }
    ),
    "tests/test_review_generate.py": frozenset(
        {"test_generate_on_gloo_refuses_what_differs_across_ranks"}
    ),
    "tests/test_review_training.py": frozenset(
        {
            "test_uneven_padding_zero1_on_gloo",
            "test_optimizer_built_before_fsdp_raises_at_step_on_gloo",
            "test_bf16_autocast_and_compiled_forward_follow_one_device",
            "test_accumulation_tied_frozen_groups_and_zero_equal_one_device",
        }
    ),
    "tests/test_moe_compile_gloo.py": frozenset({"test_compiled_moe_step_on_gloo"}),
    "tests/test_forward_mode.py": frozenset({"test_real_ranks_refuse_forward_mode"}),
    "tests/test_randomness_refused.py": frozenset(
        {
            "test_a_draw_on_real_ranks_raises_at_the_first_call",
            "test_a_compiled_training_step_keeps_the_check_out_of_the_graph",
        }
    ),
    "tests/test_dit_compose.py": frozenset({"test_checkpoint_saved_at_tp_sp_loads_at_sp4"}),
    "tests/test_review_fixes.py": frozenset(
        {"test_context_parallel_generate_with_a_static_cache_on_gloo_is_refused"}
    ),
    "tests/test_ulysses_packed.py": frozenset({"test_values_and_gradients_on_gloo"}),
    "tests/test_pipeline_dit.py": frozenset({"test_pp2_on_gloo_equals_one_device"}),
    "tests/test_activation_checkpointing.py": frozenset(
        {
            "test_hf_checkpointing_on_gloo",
            "test_checkpoint_in_per_rank_code_on_gloo",
            "test_hf_checkpointing_with_data_parallel_engines_on_gloo",
            "test_frozen_embeddings_with_reentrant_checkpointing_on_gloo",
        }
    ),
    "tests/test_autograd_function_simulate.py": frozenset(
        {
            "test_compiled_functions_on_real_ranks_are_exact",
            "test_compiled_simulate_refuses_a_function_with_gradients",
            "test_torch_compile_of_vmap_drops_a_functions_backward",
            "test_what_compiles_with_such_functions",
            "test_compiled_module_forward_under_simulate",
        }
    ),
    "tests/test_calibrate.py": frozenset({"test_calibrate_on_gloo_reproduces_held_out_sizes"}),
    "tests/test_halo.py": frozenset({"test_halo_exchange_and_domain_conv_on_gloo"}),
    "tests/test_domain.py": frozenset(
        {
            "test_a_layer_outside_its_region_raises_on_gloo",
            "test_unet_like_stack_on_gloo",
            "test_wan_causal_conv",
            "test_with_data_parallelism_on_gloo",
        }
    ),
    "tests/test_domain_compose.py": frozenset(
        {
            "test_ddp_and_fsdp_engines_over_dp_times_h_on_gloo",
            "test_domain_benchmark_smoke_run",
            "test_text_to_video_step_on_gloo",
        }
    ),
    "tests/test_context_parallel.py": frozenset({"test_wan_ulysses_on_gloo"}),
    "tests/test_dit_families_joint.py": frozenset({"test_hunyuan_video_and_cogvideox_on_gloo"}),
    "tests/test_context_dit_families.py": frozenset({"test_ltx_video_checkpointed_on_gloo"}),
    "tests/test_dit_tp_families.py": frozenset({"test_flux_tp_on_gloo"}),
    "tests/test_pipeline_context.py": frozenset(
        {"test_pp2_cp2_on_gloo_processes_equals_one_device"}
    ),
    "tests/test_review_silent.py": frozenset(
        {"test_gradient_checkpointing_equals_one_device_or_raises_on_gloo"}
    ),
    "tests/test_context_modes.py": frozenset(
        {
            "test_wan_usp_uneven_on_gloo",
            "test_checkpointed_blocks_recompute_with_their_own_split_on_gloo",
        }
    ),
    "tests/test_context_mmdit.py": frozenset(
        {
            "test_sd3_usp_uneven_on_gloo",
            "test_flux_and_sd35_ulysses_uneven_on_gloo",
            "test_checkpointed_blocks_recompute_with_their_own_split_on_gloo",
        }
    ),
    "tests/test_video_dit_example.py": frozenset(
        {"test_example_on_gloo", "test_example_without_torchrun"}
    ),
    "tests/test_checkpoint_fail_whole.py": frozenset(
        {"test_on_gloo_a_damaged_checkpoint_fails_whole_on_every_rank"}
    ),
    "tests/test_calibrate_kernels.py": frozenset(
        {"test_calibrate_kernels_predicts_held_out_steps_on_gloo"}
    ),
    "tests/test_checking.py": frozenset(
        {"test_spmd_under_torch_compile", "test_compiled_unchecked_spmd_equals_checked_eager"}
    ),
    "tests/test_cross_entropy.py": frozenset({"test_cross_entropy_on_gloo"}),
    "tests/test_cross_entropy_chunks.py": frozenset(
        {"test_chunked_causal_lm_loss_on_two_gloo_ranks"}
    ),
    "tests/test_fakecomm.py": frozenset({"test_three_processes"}),
    "tests/test_generate.py": frozenset({"test_generate_on_gloo_equals_one_device"}),
    "tests/test_lazy_imports.py": frozenset(
        {
            "test_import_fastdist_imports_no_torch_and_first_use_nothing_heavy",
            "test_fd_simulate_stays_the_function_when_its_module_is_imported_first",
        }
    ),
    "tests/test_mesh_without.py": frozenset(
        {
            "test_slices_of_pp2_tp2_talk_only_inside_the_slice",
            "test_each_slice_parallelizes_its_own_model",
            "test_a_failure_in_one_slice_names_its_ranks_and_spares_the_other",
            "test_slices_of_pp2_dp2_tp2_on_eight_ranks",
            "test_a_slice_keeps_the_ctypes_backend",
        }
    ),
    "tests/test_meta.py": frozenset({"test_meta_llama_on_two_gloo_processes"}),
    "tests/test_moe.py": frozenset({"test_moe_on_gloo"}),
    "tests/test_moe_mask.py": frozenset({"test_masked_call_with_router_logits_on_gloo"}),
    "tests/test_nn.py": frozenset(
        {
            "test_layers_on_gloo",
            "test_ring_attention_with_merged_projection_compiled",
            "test_merged_sequence_parallel_projection_compiles_with_dynamic_shapes",
        }
    ),
    "tests/test_pipeline_checkpoint.py": frozenset({"test_pipeline_checkpoint_on_gloo"}),
    "tests/test_profile.py": frozenset(
        {
            "test_dry_run_4096_ranks_resident_memory",
            "test_real_ranks_profile_like_plain_mesh",
            "test_planner_tp_sp_dp_closed_form",
        }
    ),
    "tests/test_reduction_dtypes.py": frozenset({"test_real_ranks_follow_the_same_rule"}),
    "tests/test_speculative_example.py": frozenset(
        {
            "test_speculative_example_on_gloo_equals_one_device",
            "test_without_torchrun_it_says_how_to_launch_it",
        }
    ),
    "tests/test_serving_transfers.py": frozenset(
        {
            "test_tensor_dict_between_stages_with_and_without_the_all_gather",
            "test_mismatched_or_overlapping_all_gather_axis_raises",
            "test_graph_capture_creates_the_communicators_first",
        }
    ),
    "tests/test_testing_toolkit.py": frozenset(
        {
            "test_the_same_check_runs_on_gloo_processes",
            "test_run_on_gloo_returns_every_rank_result",
            "test_run_on_gloo_from_a_forkserver",
            "test_run_on_gloo_reports_the_failing_rank",
            "test_run_on_gloo_returns_results_holding_many_tensors",
            "test_run_on_gloo_reports_a_rank_that_died_promptly",
            "test_run_on_gloo_times_out_and_says_so",
            "test_concurrent_run_on_gloo_calls_do_not_collide",
        }
    ),
    "tests/test_train_dp.py": frozenset(
        {
            "test_engines_on_gloo_equal_one_device",
            "test_review_cases_on_gloo",
            "test_a_peer_that_never_reduces_is_reported_within_the_timeout",
        }
    ),
    "tests/test_verify_auto.py": frozenset({"test_verify_and_auto_on_two_gloo_processes"}),
    "tests/test_review6_errors.py": frozenset(
        {"test_torch_func_over_real_collectives_is_refused_and_the_mesh_stays_usable"}
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests named in ``SLOW_FILES`` and ``SLOW_TESTS`` with ``slow``; warn about names
    there that no longer exist (a renamed slow test would otherwise land in the fast tier)."""
    stale = [f for f in SLOW_FILES | SLOW_TESTS.keys() if not (config.rootpath / f).is_file()]
    for item in items:
        try:
            where = item.path.relative_to(config.rootpath).as_posix()
        except ValueError:  # a test outside the repository
            continue
        name = getattr(item, "originalname", item.name)
        if where in SLOW_FILES or name in SLOW_TESTS.get(where, ()):
            item.add_marker(pytest.mark.slow)
        module = getattr(item, "module", None)
        if module is not None and where in SLOW_TESTS:
            stale += [f"{where}::{n}" for n in SLOW_TESTS[where] if not hasattr(module, n)]
    for what in sorted(set(stale)):
        warnings.warn(
            f"tests/conftest.py marks {what} slow, which does not exist: update the list",
            pytest.PytestConfigWarning,
            stacklevel=1,
        )


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Every test starts with dynamo's caches empty (about 20 us when nothing was compiled).

    A compile that graph-breaks inside ``fd.simulate`` leaves frames of fastdist's internals
    compiled on their own (e.g. ``apply_function``); a later ``fullgraph`` compile of a
    simulated step in the same process then meets them inside simulate's vmap and dynamo refuses
    ("Calling torch.func.vmap(compiled_fn) ... from eager mode"). Tests are independent of
    their order only with the caches reset.
    """
    yield
    torch._dynamo.reset()
