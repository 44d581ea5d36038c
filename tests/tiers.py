"""The test tiers (issue 40; docs/testing.md): `pytest` runs the fast tier, `pytest --full` everything.

A test is in the slow tier only because of its measured time: SLOW maps its node id (a parametrized
test's id without the brackets covers every parametrization) to the seconds it took (setup included)
in the full run recorded in docs/testing.md: `pytest --cov --durations=0` on 2 cores of an AVX-512
EPYC made to compute as an AVX2-only CPU (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2, the CPU
flags read as without bf16), 2026-11-27. Every unit test stays fast but the zoo sweeps' full runs
(their quick subsets stay) and CLIP's compile and capture cases beyond FastCLIP-v3's (issue 51); an integration test moved here took 7.5 s or more, unless KEEP_FAST
names it. KEEP_FAST names the tests that keep every engine, task, data format and
failure mode in the fast tier whatever their time; tests/unit/test_suite_layout.py checks that none of
them is slow and that every SLOW entry names a test that exists."""

SLOW: dict[str, float] = {
    # issue 51 item 5's CLIP capture and compile cases, as their author measured them (10-20 s and
    # 10-14 s each, 2026-11-28): FastCLIP-v3's case of each stays fast; the fast tier had reached
    # 593 s in a fresh clone on 2 cores of the AVX-512 EPYC
    "tests/unit/test_clip_capture.py::test_the_captured_clip_step_replayed_equals_the_eager_step_bit_for_bit[openclip]": 15.0,
    "tests/unit/test_clip_capture.py::test_the_captured_clip_step_replayed_equals_the_eager_step_bit_for_bit[fastclip_v0]": 15.0,
    "tests/unit/test_clip_capture.py::test_the_captured_clip_step_replayed_equals_the_eager_step_bit_for_bit[fastclip_v2]": 15.0,
    "tests/unit/test_clip_capture.py::test_the_fastclip_loss_compiles_whole_and_keeps_the_eager_state_within_the_fp32_bound[fastclip_v0]": 12.0,
    "tests/unit/test_clip_capture.py::test_the_fastclip_loss_compiles_whole_and_keeps_the_eager_state_within_the_fp32_bound[fastclip_v2]": 12.0,
    # measured 2026-11-28 on 2 cores of an AVX-512 EPYC, not emulated, beside another job: issue 51
    # item 5, CLIP's whole step compiled (fullgraph) beside eager, one compile each
    "tests/unit/test_clip_capture.py::test_the_clip_step_compiles_whole_without_a_graph_break": 174.3,
    "tests/integration/test_gpu_session.py::test_the_clip_part_on_the_image": 77.5,
    # measured 2026-11-28 on 2 cores of an AVX-512 EPYC: issue 51's Mega Cache, two compiling processes
    "tests/integration/test_compile_cache.py::test_the_mega_cache_round_trip_in_two_processes": 48.7,
    "tests/integration/test_gpu_session.py::test_the_knobs_part_on_the_image": 75.0,
    # measured 2026-11-28 on 2 cores of an AVX-512 EPYC, loaded by other work: issue 50's GPU search part
    "tests/integration/test_gpu_session.py::test_the_search_part_on_the_image": 150.0,
    # measured 2026-11-28 on 2 cores of an AVX-512 EPYC under -n 2, not emulated: issue 50's Muon
    "tests/integration/test_muon_dist.py::test_muon_on_a_mesh_trains_the_one_process_run[hsdp2x2]": 19.0,
    "tests/integration/test_muon_dist.py::test_muon_resumes_onto_another_mesh": 12.9,
    "tests/integration/test_muon_dist.py::test_muon_on_a_mesh_trains_the_one_process_run[tp2]": 12.3,
    # measured 2026-11-28 on 2 cores of an AVX-512 EPYC, not emulated: issue 49's meshes
    "tests/integration/test_failures.py::test_kill_9_then_resume_is_bit_equal[hsdp-launcher]": 42.4,
    "tests/integration/test_failures.py::test_kill_9_then_resume_is_bit_equal[tp-ranks]": 25.6,
    "tests/integration/test_preemption.py::test_a_stop_signal_saves_the_step_every_rank_stopped_at_and_the_resume_is_bit_equal[hsdp-SIGUSR1-all]": 24.0,
    "tests/integration/test_preemption.py::test_a_stop_signal_saves_the_step_every_rank_stopped_at_and_the_resume_is_bit_equal[tp-SIGTERM-launcher]": 14.8,
    "tests/integration/test_mesh_dist.py::test_a_checkpoint_moves_between_meshes": 29.3,
    "tests/integration/test_mesh_dist.py::test_clip_under_fsdp_x_tp_trains_the_one_process_run": 17.7,
    "tests/integration/test_mesh_dist.py::test_a_mesh_trains_the_one_process_run[fsdp2xtp2]": 14.3,
    "tests/integration/test_mesh_dist.py::test_a_mesh_trains_the_one_process_run[ddp2xtp2]": 14.2,
    "tests/integration/test_mesh_dist.py::test_a_mesh_trains_the_one_process_run[hsdp2x2]": 11.7,
    "tests/integration/test_mesh_dist.py::test_a_mesh_trains_the_one_process_run[tp2sp]": 10.1,
    # measured 2026-11-28 on 2 cores of an AVX-512 EPYC, not emulated: issue 52's torchrun case
    "tests/integration/test_preemption.py::test_sigterm_to_the_launcher_in_the_final_evaluation_saves_and_the_resumes_finish": 14.5,
    "tests/integration/test_gpu_session.py::test_the_default_part_on_the_image": 97.7,
    "tests/integration/test_gpu_session.py::test_the_peer_part_on_the_image": 73.2,
    "tests/integration/test_deepspeed.py::test_engine_checkpoint_resumes_exactly": 56.6,
    "tests/integration/test_gpu_session.py::test_bench_and_deepspeed_parts_on_the_image": 44.9,
    # measured 2026-12-06 on 2 cores of a Xeon with AVX-512 BF16, one process: issue 58's timm
    # towers (SigLIP, SigLIP 2, EVA-CLIP, PE-Core) now load, 39 more configurations run whole
    "tests/unit/test_zoo_open_clip.py::test_every_open_clip_configuration_is_exact_or_refused[all]": 95.0,
    "tests/integration/test_checkpoints_dist.py::test_single_resumes_under_fsdp_and_back": 35.4,
    "tests/integration/test_failures.py::test_kill_9_then_resume_is_bit_equal[fsdp-ranks]": 35.3,
    "tests/integration/test_failures.py::test_kill_9_then_resume_is_bit_equal[zero2-ranks]": 35.0,
    "tests/integration/test_search_processes.py::test_a_killed_search_continues_from_its_database": 33.9,
    "tests/unit/test_zoo_timm.py::test_every_timm_vit_is_exact_or_refused_with_its_cause[all]": 33.01,
    # measured 2026-12-06 on 2 cores of a Xeon with AVX-512 BF16: issue 62's torchrun refusal (4 ranks)
    "tests/integration/test_elastic.py::test_under_torchrun_a_refusal_is_printed_by_rank_0_only": 11.8,
    "tests/integration/test_elastic.py::test_a_stop_signal_to_the_command_saves_every_rank_and_exits_128_plus_it": 16.2,
    # measured 2026-12-06 on 2 cores of a Xeon with AVX-512 BF16, under -n 2: issue 58's SigLIP loss on
    # 3 and 4 gloo ranks (the 2-rank cases stay fast) and its FSDP2 training case (DDP's stays)
    "tests/integration/test_siglip_dist.py::test_every_rank_equals_open_clip_and_the_float64_formula[3]": 7.0,
    "tests/integration/test_siglip_dist.py::test_every_rank_equals_open_clip_and_the_float64_formula[4]": 9.5,
    "tests/integration/test_siglip_dist.py::test_a_process_group_of_some_ranks[3]": 9.7,
    "tests/integration/test_siglip_dist.py::test_a_process_group_of_some_ranks[4]": 8.4,
    "tests/integration/test_clip_train_dist.py::test_two_ranks_match_single_process[siglip-extra6-1e-05]": 10.3,
    # measured 2026-12-06 as above: the fast tier had grown from 278 s to 373 s with issues 58 and
    # 62; these multi-process cases repeat what a fast unit test or the fast tier's DDP case shows
    "tests/integration/test_clip_train_dist.py::test_two_ranks_match_single_process[siglip-extra5-1e-05]": 8.9,
    "tests/integration/test_siglip_dist.py::test_a_process_group_of_some_ranks[2]": 7.4,
    "tests/integration/test_elastic.py::test_two_ranks_train_the_one_process_run": 7.1,
    # measured 2026-12-06 on 2 cores of a Xeon with AVX-512 BF16, under -n 2: issue 58's blocks on
    # FSDP x TP 2x2 (one process and four each)
    "tests/integration/test_mesh_dist.py::test_the_modern_blocks_train_the_one_process_run_under_fsdp_x_tp": 15.0,
    # measured 2026-12-06 on 2 cores of a Xeon with AVX-512 BF16, under -n 2: issue 58's eva sweep
    "tests/unit/test_zoo_timm_eva.py::test_every_timm_eva_is_exact_or_refused_with_its_cause[all]": 18.9,
    "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra7-1e-05]": 28.1,
    "tests/integration/test_failures.py::test_torchrun_restart_resumes_from_the_last_checkpoint": 26.6,
    "tests/integration/test_failures.py::test_kill_9_then_resume_is_bit_equal[ddp-launcher]": 24.7,
    "tests/integration/test_gpu_session.py::test_the_capture_part_on_the_image": 24.5,
    "tests/integration/test_failures.py::test_kill_9_then_resume_is_bit_equal[single-ranks]": 24.5,
    "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra6-0.02]": 22.3,
    "tests/integration/test_distributed_eval.py::test_live_checkpoint_and_resumed_evaluations_agree[deepspeed-True]": 22.3,
    "tests/integration/test_distributed.py::test_ddp_two_ranks_match_single_process[extra5-0.05]": 21.0,
    "tests/integration/test_checkpoints_dist.py::test_sharded_resumes_on_one_rank": 20.3,
    "tests/integration/test_distributed.py::test_ddp_two_ranks_match_single_process[extra6-1e-05]": 19.9,
    "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra3-1e-05]": 16.5,
    "tests/integration/test_distributed.py::test_fsdp_checkpoint_resumes_on_another_world_size": 16.0,
    "tests/integration/test_clip_train_dist.py::test_two_ranks_match_single_process[fastclip_v3-extra4-1e-05]": 15.8,
    "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra2-1e-05]": 15.3,
    "tests/integration/test_launchers.py::test_deepspeed_launcher_two_ranks_match_single_process": 15.0,
    "tests/integration/test_search_processes.py::test_two_workers_share_one_study": 14.9,
    "tests/integration/test_distributed_eval.py::test_live_checkpoint_and_resumed_evaluations_agree[ddp-True]": 14.8,
    "tests/integration/test_failures.py::test_hung_rank_times_out_instead_of_hanging": 13.9,
    "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra4-1e-05]": 13.7,
    "tests/integration/test_gpu_session.py::test_carried_wheels_go_to_a_target_folder_on_the_path": 12.2,
    "tests/integration/test_clip_train_dist.py::test_two_ranks_match_single_process[fastclip_v2-extra2-1e-05]": 11.6,
    "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra0-1e-05]": 11.6,
    "tests/integration/test_deepspeed.py::test_zero3_matches_single_process_and_user_config_is_merged": 11.0,
    "tests/integration/test_gpu_session.py::test_a_failing_tf32_check_stops_the_script": 10.8,
    "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra5-1e-05]": 10.8,
    "tests/integration/test_clip_train_dist.py::test_two_ranks_match_single_process[fastclip_v3-extra1-1e-05]": 10.8,
    "tests/integration/test_clip_train_dist.py::test_two_ranks_match_single_process[fastclip_v2-extra3-1e-05]": 10.3,
    "tests/integration/test_clip_losses_dist.py::test_gradients_state_and_temperatures_match_single_process[3]": 10.0,
    "tests/integration/test_checkpoints_dist.py::test_sharded_layout": 9.7,
    "tests/integration/test_distributed.py::test_ddp_two_ranks_match_single_process[extra4-1e-05]": 9.7,
    "tests/integration/test_distributed_eval.py::test_live_checkpoint_and_resumed_evaluations_agree[fsdp-False]": 9.4,
    "tests/integration/test_clip_train_dist.py::test_two_ranks_get_full_batches_despite_a_corrupt_image[stream]": 9.1,
    "tests/integration/test_deepspeed.py::test_one_process_without_a_launcher": 9.0,
    "tests/integration/test_distributed.py::test_ddp_two_ranks_match_single_process[extra2-0.02]": 8.8,
    "tests/integration/test_multinode.py::test_sbatch_script_two_nodes_match_single_process": 8.7,
    "tests/integration/test_distributed.py::test_ddp_two_ranks_match_single_process[extra1-1e-05]": 8.2,
    "tests/integration/test_bench_dist.py::test_bench_two_processes_ddp": 8.2,
    "tests/integration/test_distributed_eval.py::test_an_epoch_ending_in_fewer_samples_than_processes_skips_that_step_on_every_rank": 8.0,
    "tests/integration/test_distributed.py::test_fsdp_uneven_eval_shards_do_not_hang": 7.9,
    "tests/integration/test_gpu_session.py::test_missing_package_named_in_one_line": 7.8,
    "tests/integration/test_multinode.py::test_srun_without_torchrun_two_tasks_match_single_process": 7.7,
    # issue 43, measured 2026-11-27 on this CPU's own instructions, every case (zero2 16.6, compile
    # 15.2 with inductor's cache warm, 109.7 cold under load: it compiles the masked step, the
    # evaluation and the unmasked tail; fsdp 9.9, ddp 8.1)
    "tests/integration/test_patch_dropout_dist.py::test_patch_dropout_trains_under_each_engine": 49.7,
    # quick themselves, but they share a module fixture with slow tests above: in the fast tier alone
    # they would pay its run (the seconds are the fixture's)
    "tests/integration/test_checkpoints_dist.py::test_sharded_resumes_under_single_and_exports": 9.7,
    "tests/integration/test_deepspeed.py::test_eval_and_export_of_a_deepspeed_run": 10.9,
    "tests/integration/test_clip_losses_dist.py::test_comm_elements_follow_the_formulas[3]": 10.0,
    "tests/integration/test_clip_losses_dist.py::test_sharded_state_is_bit_identical_to_replicated[3]": 10.0,
    # issue 44, measured 2026-11-27 on this session's CPU's own instructions (its reference run included)
    "tests/integration/test_preemption.py::test_a_stop_signal_saves_the_step_every_rank_stopped_at_and_the_resume_is_bit_equal[zero2-SIGUSR1-all]": 24.3,
    "tests/integration/test_preemption.py::test_a_stop_signal_saves_the_step_every_rank_stopped_at_and_the_resume_is_bit_equal[fsdp-SIGINT-launcher]": 20.0,
    "tests/integration/test_preemption.py::test_a_stop_signal_saves_the_step_every_rank_stopped_at_and_the_resume_is_bit_equal[single-SIGUSR1-process]": 16.6,
    # measured 2026-12-06 on this session's machine, beside other jobs: issue 62 items 4 and 5 (the
    # DDP case of a refused save stays fast: 9.6 s)
    "tests/integration/test_save_failures.py::test_a_kill_during_a_zero2_save_leaves_no_orphan_once_the_run_finishes": 35.0,
    "tests/integration/test_save_failures.py::test_a_refused_save_is_one_line_and_exit_2_on_every_rank[zero2-1-kept2]": 16.4,
    "tests/integration/test_save_failures.py::test_a_refused_save_is_one_line_and_exit_2_on_every_rank[fsdp-1-kept1]": 14.1,
}

# one test per engine, task, data format and failure mode stays in the fast tier
KEEP_FAST: dict[str, str] = {
    "single": "tests/unit/test_train.py::test_resumed_run_ends_with_the_same_weights",
    "ddp": "tests/integration/test_distributed.py::test_ddp_two_ranks_match_single_process[extra0-1e-05]",
    "fsdp": "tests/integration/test_distributed.py::test_ddp_two_ranks_match_single_process[extra3-1e-05]",
    "zero2": "tests/integration/test_deepspeed.py::test_deepspeed_two_ranks_match_single_process[extra1-1e-05]",
    "clip": "tests/integration/test_clip_train_dist.py::test_two_ranks_match_single_process[openclip-extra0-1e-05]",
    "kill -9 resume": "tests/integration/test_failures.py::test_kill_9_then_resume_is_bit_equal[ddp-ranks]",
    "stop signal": "tests/integration/test_preemption.py::test_a_stop_signal_saves_the_step_every_rank_stopped_at_and_the_resume_is_bit_equal[ddp-SIGTERM-launcher]",
    "dead rank": "tests/integration/test_failures.py::test_killed_rank_stops_the_other_with_a_clear_error",
    "corrupt sample": "tests/integration/test_clip_train_dist.py::test_two_ranks_get_full_batches_despite_a_corrupt_image[csv]",
    "csv": "tests/integration/test_clip_train_dist.py::test_two_ranks_get_full_batches_despite_a_corrupt_image[csv]",
    "webdataset": "tests/integration/test_data_stream_dist.py::test_two_ranks_stream_disjoint_shards_under_ddp",
    "timm zoo": "tests/unit/test_zoo_timm.py::test_every_timm_vit_is_exact_or_refused_with_its_cause[quick]",
    "open_clip zoo": "tests/unit/test_zoo_open_clip.py::test_every_open_clip_configuration_is_exact_or_refused[quick]",
    "tensor parallel": "tests/integration/test_mesh_dist.py::test_a_mesh_trains_the_one_process_run[tp2]",
    "gpu_session": "tests/integration/test_gpu_session.py::test_dry_run_on_the_image_records_versions_and_stops_at_the_gpu_check",
}


def is_slow(nodeid: str) -> bool:
    return nodeid in SLOW or nodeid.split("[")[0] in SLOW
