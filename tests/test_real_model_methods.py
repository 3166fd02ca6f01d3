"""bench/real_model_methods.py's arithmetic and presets: the comparison line, the standard errors, the
equal-token alignment, the rows' flags as train_math resolves them, and (slow) the workflow method end to end on
the tiny policy (the real-model runs themselves are the bench's, and the real_model tests')."""

from __future__ import annotations

import csv
import math
import shutil

import pytest

from bench.real_model_learning import model_identity, weights_digest
from bench.real_model_methods import (DEBATES, METHODS, PREFIX_ARITH, PREFIX_KL, PREFIX_TOKENS, ROWS,
                                      SAMPLES_PER_ITERATION, TARGET_TOKENS, WORKFLOW_SAMPLES, Method, align_at,
                                      comparison, comparisons, keep_history, kept_history, main, mean_and_error,
                                      parse_args, row_flags)


def history(*accuracies: float, tokens_per_iteration: int = 1000, metric: str = "eval/accuracy"
            ) -> list[dict[str, float]]:
    return [{metric: a, "eval/accuracy": a, "iteration": i, "env_steps": 64 * i, "seconds": 60.0 * i,
             "generated_tokens": tokens_per_iteration * i, "eval/mean_length": 9.0}
            for i, a in enumerate(accuracies)]


def test_a_mean_of_seeds_takes_the_larger_of_the_binomial_error_and_the_seeds_spread():
    close = {0: history(0.2, 0.5), 1: history(0.2, 0.5)}  # no spread: binomial, sqrt(2 * .25 / 500) / 2
    assert mean_and_error(close, 500) == (0.5, pytest.approx(math.sqrt(2 * 0.25 / 500) / 2))
    apart = {0: history(0.2, 0.3), 1: history(0.2, 0.7)}  # sd 0.283 over sqrt(2): 0.2
    assert mean_and_error(apart, 500) == (pytest.approx(0.5), pytest.approx(0.2))


def test_the_comparison_line_states_both_runs_the_gain_and_its_standard_errors():
    results = {"prefix_rl": {0: history(0.2, 0.6), 1: history(0.2, 0.6)},
               "target_alone": {0: history(0.18)}}  # a frozen model: one run, whatever the seeds
    line = comparison("prefix_rl", "target_alone", results, 500)
    error = math.hypot(math.sqrt(2 * 0.24 / 500) / 2, math.sqrt(0.18 * 0.82 / 500))
    assert line == (f"prefix_rl 0.200 -> 0.600 vs target_alone 0.180 -> 0.180 at equal samples (+42.0 points, "
                    f"{0.42 / error:.1f} standard errors)")


def parsed_row(row: str, policy_dir, tmp_path, *argv: str):
    """train_math's config of ``row``'s flags for seed 0, every model ``policy_dir``."""
    from test_train_math import parse

    args = parse_args(["--method", "prime", "--model", str(policy_dir), "--out", str(tmp_path), *argv])
    model = str(policy_dir)
    return parse(*row_flags(row, 0, args, {"model": model, "target": model, "writer": model}), "--logdir",
                 str(tmp_path))


@pytest.mark.parametrize("row", [row for name in ("prefix_rl", "prime", "prime_dynamic", "prime_filter_truncated",
                                                  "prime_min_form", "prime_min_form_step")
                                 for row in (METHODS[name].trained, *METHODS[name].controls)])
def test_every_row_is_a_train_math_command_that_resolves(row, untrained_policy_dir, tmp_path):
    """Parsed and resolved by train_math's own flags; equal generated samples at every evaluation (a row
    compared at the trained row's samples: --margin times the budget, evaluated twice as often)."""
    config = parsed_row(row, untrained_policy_dir, tmp_path, "--iterations", "16", "--eval_interval", "8")
    assert config.env.prompt_template == "chat" and config.generation.temperature == 0.3
    if ROWS[row].val_only:
        assert config.budget.val_only and config.generation.max_new_tokens == PREFIX_TOKENS + TARGET_TOKENS
        return
    samples = config.env.num_envs * (config.prime.oversample_factor if config.learning.algorithm == "RLOO" else 1)
    margin, density = (1.5, 2) if ROWS[row].equal_at else (1, 1)
    assert samples * config.budget.num_iterations == margin * 16 * SAMPLES_PER_ITERATION
    assert samples * config.budget.eval_interval * density == 8 * SAMPLES_PER_ITERATION
    if row == "prefix_rl":
        assert config.generation.max_new_tokens == PREFIX_TOKENS and config.prefix_rl.target_max_new_tokens == 128
        assert config.learning.kl_coef == PREFIX_KL and config.learning.kl_loss_type == "low_var_kl"
        assert (config.model.lora_rank, config.learning.lr) == (16, 1e-4)  # the writer: a LoRA adapter
    else:
        assert (config.model.lora_rank, config.learning.lr) == (0, 2e-5)
    pairs = ("prime_dynamic", "prime_filter_truncated")
    if row in (*METHODS["prime"].controls, *(control for name in pairs for control in METHODS[name].controls)):
        assert config.prime.process_coef == 0
    # PRIME's code's sampling: every group with a right and a wrong answer
    if row in (*pairs, "prime_min_form", "prime_min_form_step", "rloo_dynamic", "rloo_filter_truncated"):
        assert config.prime.oversample_factor == 1 and config.rollout.filter_groups
        assert (config.prime.accuracy_lower_bound, config.prime.accuracy_upper_bound) == (0.1, 0.9)
        assert config.prime.filter_truncated == row.endswith("filter_truncated")
        assert config.prime.process_credit_assignment == ("min_form" if "min_form" in row else "sum_form")
        assert config.prime.prime_granularity == ("step" if row.endswith("_step") else "token")


def test_prefix_rl_trains_and_is_tested_on_one_form_of_problem():
    """Its rows take three-number sums; their train and held-out sets are disjoint and of that one form (the
    shared task's held-out set holds every two-number sum, its training set none)."""
    from envs.datasets import Arith

    assert {ROWS[row].arith["min_ops"] for row in ("prefix_rl", *METHODS["prefix_rl"].controls)} == {2}
    knobs = {key: PREFIX_ARITH[key] for key in ("digits", "min_ops", "max_ops", "operators")}
    train, test = Arith(**knobs).split(PREFIX_ARITH["num_train"], PREFIX_ARITH["num_test"], 0)
    assert (len(train), len(test)) == (500, 500) and not {p.id for p in train} & {p.id for p in test}
    assert {p.level for p in train} == {p.level for p in test} == {2}
    shared_train, shared_test = Arith(**{**knobs, "min_ops": 1}).split(500, 500, 0)
    assert {p.level for p in shared_train} == {2} and sum(p.level == 1 for p in shared_test) == 100


def test_a_kept_run_is_reused_at_its_settings_and_refused_at_others(tmp_path):
    """keep_history writes a finished run's history with its settings; the same row, seed, model and flags read
    it back (another --out too: the flags name the model directories by placeholder), other flags raise."""
    args = parse_args(["--method", "prime", "--model", "/models/smollm2", "--out", str(tmp_path / "a"),
                       "--iterations", "16", "--eval_interval", "8"])
    keep = tmp_path / "kept"
    assert kept_history(keep, "prime", 1, args) is None
    keep_history(keep, "prime", 1, args, history(0.2, 0.5))
    elsewhere = parse_args(["--method", "prime", "--model", "/models/smollm2", "--out", str(tmp_path / "b"),
                            "--iterations", "16", "--eval_interval", "8"])
    assert kept_history(keep, "prime", 1, elsewhere) == history(0.2, 0.5)
    assert kept_history(keep, "prime", 0, elsewhere) is None  # another seed: not kept
    longer = parse_args(["--method", "prime", "--model", "/models/smollm2", "--iterations", "32"])
    with pytest.raises(ValueError, match="give another --keep"):
        kept_history(keep, "prime", 1, longer)
    other_model = parse_args(["--method", "prime", "--model", "/models/other", "--iterations", "16",
                              "--eval_interval", "8"])
    with pytest.raises(ValueError, match="prime_seed_1.json holds a run of"):
        kept_history(keep, "prime", 1, other_model)


def test_a_model_directory_is_known_by_its_weights_wherever_it_lies(tmp_path):
    for name, weights in (("a", b"\x01"), ("b", b"\x01"), ("c", b"\x02")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(weights)
    assert model_identity(str(tmp_path / "a")) == model_identity(str(tmp_path / "b")) == (
        f"sha256:{weights_digest(tmp_path / 'a')}")
    assert model_identity(str(tmp_path / "c")) != model_identity(str(tmp_path / "a"))
    assert model_identity("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_rows_pick_a_subset_of_the_methods_rows_and_compare_the_controls_present():
    args = parse_args(["--method", "prime", "--model", "m", "--rows", "rloo_filter"])
    assert args.rows == ["rloo_filter"]
    assert parse_args(["--method", "prime", "--model", "m"]).rows == ["prime", "rloo_filter", "rloo"]
    with pytest.raises(SystemExit):
        parse_args(["--method", "prime", "--model", "m", "--rows", "workflow"])
    results = {"prime": {0: history(0.2, 0.6)}, "rloo": {0: history(0.2, 0.5)}}
    assert [line.split(" at ")[0] for line in comparisons(METHODS["prime"], results, 500)] == [
        "prime 0.200 -> 0.600 vs rloo 0.200 -> 0.500"]
    assert comparisons(METHODS["prime"], {"rloo": results["rloo"]}, 500) == []
    assert parse_args(["--method", "workflow", "--model", "m", "--rows", "single_majk", "workflow"]).rows == [
        "workflow", "single_majk"]  # the trained row first: workflow_untrained is read off its history

    with pytest.raises(SystemExit):  # read off the debate's first evaluation, which would not run
        parse_args(["--method", "workflow", "--model", "m", "--rows", "workflow_untrained"])


def test_the_weights_digest_sees_a_changed_weight(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 8)
    before = weights_digest(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 7 + b"\x01")
    assert weights_digest(tmp_path) != before


def test_a_writer_that_is_its_own_target_scores_the_same_alone_and_in_the_team(untrained_policy_dir):
    """bench.prefix_signal on the untrained tiny policy as writer and target: the target's greedy continuation
    of a prefix is the writer's own, so the team and the writer alone are right on the same prefixes."""
    from argparse import Namespace

    from bench.prefix_signal import team_outcomes
    from envs.datasets import Arith
    from envs.prompts import format_prompt
    from models.generation import HFGenerator
    from models.policy import LanguagePolicy

    policy = LanguagePolicy(untrained_policy_dir, device="cpu").eval()
    problems = Arith().problems(3, seed=4)
    args = Namespace(group_size=4, prefix_tokens=4, target_tokens=6, seed=0)
    result = team_outcomes(HFGenerator(policy), HFGenerator(policy), [format_prompt(p.problem) for p in problems],
                           [p.answer for p in problems], args, temperature=1.0)
    assert result["team"] == result["writer_alone"] and 1 <= result["distinct"] <= 4
    assert 0 <= result["mixed_groups"] <= 1 and result["prefix_tokens"] <= 4


@pytest.mark.parametrize("row", ["workflow", "grpo_equal_tokens", "single_majk"])
def test_the_workflow_rows_resolve_to_a_debate_of_adapters_and_its_single_agent_controls(row, untrained_policy_dir,
                                                                                          tmp_path):
    """24 iterations of 64 samples: the debate's 8 iterations of 32 debates x 6 messages, the GRPO row 1.5 times
    that in iterations of 64, evaluated 3 times as often; both on LoRA rank 16 at lr 1e-4 (overriding the task's
    full fine-tuning lr)."""
    config = parsed_row(row, untrained_policy_dir, tmp_path, "--iterations", "24", "--eval_interval", "6")
    assert config.env.prompt_template == "chat" and config.generation.temperature == 0.3
    assert config.generation.max_new_tokens == 128 and config.budget.val_only == ROWS[row].val_only
    if row.startswith("workflow"):
        assert config.env.env_id == "Arith-Debate-v0" and config.env.num_envs == DEBATES
        assert not config.multi_agent.share_policy and config.model.lora_rank == 16 and config.learning.lr == 1e-4
        assert config.multi_agent.agent_groups == "at_grpo" and config.multi_agent.reward_assignment == "individual"
        assert config.budget.eval_batch_size == 32
    if row == "workflow":
        assert config.budget.num_iterations * DEBATES * WORKFLOW_SAMPLES == 24 * SAMPLES_PER_ITERATION
        assert config.budget.eval_interval == 2  # 6 x 64 samples
    if row == "grpo_equal_tokens":
        assert config.env.env_id == "Arith-v0" and config.model.lora_rank == 16 and config.learning.lr == 1e-4
        assert config.budget.num_iterations == 36 and config.budget.eval_interval == 2  # 3 times as often
    if row == "single_majk":
        assert config.budget.eval_samples == WORKFLOW_SAMPLES and config.budget.eval_temperature == 0.3
        assert ROWS[row].metric == "eval/maj_at_6"


def test_the_grpo_row_is_compared_at_its_first_evaluation_reaching_the_workflows_tokens():
    """Seed 0's debate ends at 2,000 generated tokens, seed 1's at 2,400; GRPO evaluations every 700 tokens
    reach them at 2,100 (iteration 3) and 2,800 (iteration 4): 0.4 there, whatever came after."""
    results = {"workflow": {0: history(0.2, 0.5, tokens_per_iteration=2000),
                            1: history(0.2, 0.5, tokens_per_iteration=2400)},
               "grpo_equal_tokens": {seed: history(0.2, 0.3, 0.3, 0.4, 0.4, 0.9, tokens_per_iteration=700)
                                     for seed in (0, 1)},
               "single_majk": {0: history(0.3, metric="eval/maj_at_6"), 1: history(0.3, metric="eval/maj_at_6")},
               "workflow_untrained": {0: history(0.2)}}
    aligned, ratios = align_at(results, "workflow")
    assert [h["iteration"] for h in aligned["grpo_equal_tokens"][0]] == [0, 1, 2, 3]
    assert [h["iteration"] for h in aligned["grpo_equal_tokens"][1]] == [0, 1, 2, 3, 4]
    assert ratios == {"grpo_equal_tokens": {0: 2100 / 2000, 1: 2800 / 2400}}
    lines = comparisons(METHODS["workflow"], results, 500)
    assert lines[:2] == ["grpo_equal_tokens seed 0: compared at iteration 3, 2,100 generated tokens (1.05x workflow's)",
                         "grpo_equal_tokens seed 1: compared at iteration 4, 2,800 generated tokens (1.17x workflow's)"]
    # standard errors: sqrt(2 x .25 / 500) / 2 and sqrt(2 x .24 / 500) / 2, no spread between the seeds
    z = 0.1 / math.hypot(math.sqrt(0.5 / 500) / 2, math.sqrt(0.48 / 500) / 2)
    assert f"{z:.1f}" == "4.5" and lines[2] == ("workflow 0.200 -> 0.500 vs grpo_equal_tokens 0.200 -> 0.400 at "
                                                "equal generated tokens (+10.0 points, 4.5 standard errors)")
    assert lines[3].startswith("workflow 0.200 -> 0.500 vs single_majk 0.300 -> 0.300 at equal samples (+20.0 points")
    assert lines[4].startswith("workflow 0.200 -> 0.500 vs workflow_untrained 0.200 -> 0.200 at equal samples")


def test_a_grpo_row_short_of_the_workflows_tokens_says_so_instead_of_equal():
    results = {"workflow": {0: history(0.2, 0.5, tokens_per_iteration=2000)},
               "grpo_equal_tokens": {0: history(0.2, 0.3, 0.4, tokens_per_iteration=800)}}
    aligned, ratios = align_at(results, "workflow")
    assert len(aligned["grpo_equal_tokens"][0]) == 3 and ratios["grpo_equal_tokens"][0] == 0.8
    line = comparisons(Method("workflow", ("grpo_equal_tokens",), "generated_tokens"), results, 500)[-1]
    assert line.startswith("workflow 0.200 -> 0.500 vs grpo_equal_tokens 0.200 -> 0.400 at 0.80x workflow's "
                           "generated tokens (short of equal: raise --margin) (+10.0 points")


def test_the_dynamic_sampling_control_is_compared_at_prime_s_generated_samples():
    """PRIME's rounds of generation end seed 0 at 2,112 samples; the control, evaluated at 320, 640, ... samples
    (5 rounds of 64 between evaluations), reaches them at 2,240 (iteration 7): 0.6 there, whatever came after."""
    prime = [{**h, "env_steps": 704 * h["iteration"]} for h in history(0.2, 0.4, 0.5, 0.6)]
    control = [{**h, "env_steps": 320 * h["iteration"]} for h in history(0.2, 0.3, 0.4, 0.4, 0.5, 0.5, 0.5, 0.6, 0.7)]
    results = {"prime_dynamic": {0: prime}, "rloo_dynamic": {0: control}}
    aligned, ratios = align_at(results, "prime_dynamic")
    assert aligned["rloo_dynamic"][0][-1]["iteration"] == 7 and ratios == {"rloo_dynamic": {0: 2240 / 2112}}
    lines = comparisons(METHODS["prime_dynamic"], results, 200)
    assert lines[0] == "rloo_dynamic seed 0: compared at iteration 7, 2,240 generated samples (1.06x prime_dynamic's)"
    assert lines[1].startswith("prime_dynamic 0.200 -> 0.600 vs rloo_dynamic 0.200 -> 0.600 at equal samples "
                               "(+0.0 points, 0.0 standard errors)")


@pytest.mark.slow
def test_the_workflow_method_runs_end_to_end_on_the_tiny_policy(tiny_models, tmp_path, monkeypatch, capsys):
    """The bench's workflow method on the shipped tiny policy (given a ChatML template: the bench prompts through
    the chat template), its messages cut to 16 tokens and 8 held-out problems: one debate iteration of 192
    messages, the GRPO row on to its first evaluation past the debate's generated tokens, the untrained single
    agent's maj@6 and the untrained debate; the CSV holds every row and the comparison lines are printed. Kept
    (--keep), the same report comes back from another --out without a run."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from test_prompting import CHATML

    model = tmp_path / "policy"
    shutil.copytree(tiny_models.policy, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(model)
    for row in METHODS["workflow"].controls + ("workflow",):
        monkeypatch.setitem(ROWS, row, replace(ROWS[row], overrides=(*ROWS[row].overrides, "--max_new_tokens", "16")))
    out, keep = tmp_path / "bench", tmp_path / "kept"
    argv = ["--method", "workflow", "--model", str(model), "--seeds", "0", "--iterations", "3", "--eval_interval", "3",
            "--eval_limit", "8", "--keep", str(keep)]
    main([*argv, "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(path.name for path in keep.iterdir()) == [
        "grpo_equal_tokens_seed_0.json", "single_majk_seed_0.json", "workflow_seed_0.json"]
    main([*argv, "--out", str(tmp_path / "again")])  # every run kept: none runs again, the same report
    again = capsys.readouterr().out.strip().splitlines()
    assert not (tmp_path / "again" / "runs").exists()
    def report(printed: list[str]) -> list[str]:  # the comparisons (the target's line names its --out)
        return [line for line in printed if "reusing the finished run" not in line and "frozen target" not in line]
    assert len(again) - len(report(again)) == 4 and report(again) == report(lines)
    with open(out / "curve.csv") as handle:
        curve = list(csv.DictReader(handle))
    rows = {line["row"]: [] for line in curve}
    for line in curve:
        rows[line["row"]].append(line)
    assert [int(line["iteration"]) for line in rows["workflow"]] == [0, 1]
    workflow_tokens = int(rows["workflow"][-1]["generated_tokens"])
    assert 0 < workflow_tokens <= 192 * 16  # one iteration of 32 debates x 6 messages of at most 16 tokens
    grpo = [int(line["generated_tokens"]) for line in rows["grpo_equal_tokens"]]
    assert grpo[0] == 0 and grpo[-1] >= workflow_tokens  # 4 iterations of 64: 1.5 times the debate's messages
    assert rows["single_majk"][0]["metric"] == f"eval/maj_at_{WORKFLOW_SAMPLES}" and len(rows["single_majk"]) == 1
    untrained, first = ({key: value for key, value in rows[row][0].items() if key != "row"}
                        for row in ("workflow_untrained", "workflow"))
    assert len(rows["workflow_untrained"]) == 1 and untrained == first  # the debate's first evaluation, not run
    assert not (out / "runs" / "workflow_untrained").exists()
    assert lines[-4].startswith("grpo_equal_tokens seed 0: compared at iteration ")
    assert "vs grpo_equal_tokens" in lines[-3] and " at equal generated tokens (" in lines[-3]
    assert "vs single_majk" in lines[-2] and "vs workflow_untrained" in lines[-1]
    assert (out / "curve_tokens.png").is_file() == (out / "curve_minutes.png").is_file()
