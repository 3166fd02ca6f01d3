"""PRMs, the Prefix-RL target solver and PRIME's implicit PRM on the tiny models."""

import copy
import math
import re
import shutil

import numpy as np
import pytest
import torch
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForTokenClassification

from algorithms.base import roc_auc
from envs.datasets import Arith, Problem
from envs.modes import PrimeNorm, ProcessCredit
from envs.prompts import format_prompt, join_steps, split_steps
from envs.rewards import StepContext
from reward_models.implicit_prm import BlankLines, ImplicitPRM, min_form
from reward_models.prm import (MIN_LABEL_ODDS, ProcessRewardModel, aggregate_step_scores, check_prm_dir,
                               single_token_id)
from reward_models.target_solver import TargetSolver
from models.generation import HFGenerator
from models.loading import ModelDirError
from models.policy import LanguagePolicy


def with_post_processor(tokenizer, template: str):
    """A copy of ``tokenizer`` whose encodings are wrapped as ``template`` (e.g. "<bos> $A")."""
    tokenizer = copy.deepcopy(tokenizer)
    special = tokenizer.eos_token
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=template.replace("<s>", special), special_tokens=[(special, tokenizer.eos_token_id)])
    return tokenizer


def test_single_token_detection_with_and_without_bos(tiny_tokenizer):
    plus = single_token_id(tiny_tokenizer, "+", "label", "good_token")
    assert tiny_tokenizer.convert_ids_to_tokens(plus) == "+"
    with_bos = with_post_processor(tiny_tokenizer, "<s> $A")
    with_bos.bos_token = with_bos.eos_token
    assert with_bos.encode("+")[0] == with_bos.bos_token_id
    assert single_token_id(with_bos, "+", "label", "good_token") == plus
    with pytest.raises(ValueError, match=r"'the answer' is \d+ tokens .* not one"):
        single_token_id(tiny_tokenizer, "the answer", "label", "good_token")
    appends_eos = with_post_processor(tiny_tokenizer, "$A <s>")
    with pytest.raises(ValueError, match="adds tokens other than a BOS"):
        single_token_id(appends_eos, "+", "label", "good_token")


def test_aggregations_by_hand():
    scores = [np.array([0.9, 0.5, 0.8]), np.array([0.4])]
    np.testing.assert_allclose(aggregate_step_scores(scores, "last"), [0.8, 0.4])
    np.testing.assert_allclose(aggregate_step_scores(scores, "min"), [0.5, 0.4])
    np.testing.assert_allclose(aggregate_step_scores(scores, "product"), [0.36, 0.4])
    np.testing.assert_allclose(aggregate_step_scores(scores, "mean"), [2.2 / 3, 0.4])
    with pytest.raises(ValueError, match="'max'"):
        aggregate_step_scores(scores, "max")


PROBLEMS = Arith().problems(6, seed=11)


def contexts_for(problems, done=True):
    return [StepContext(problem=p, previous_steps=tuple(split_steps(p.solution)[:-1]),
                        new_step=split_steps(p.solution)[-1], done=done) for p in problems]


def test_shepherd_prm_batched_equals_one_at_a_time(untrained_policy_dir):
    # no KV cache: each one-at-a-time call must run its own forward, not return the batched scores
    prm = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, batch_size=4, kv_cache_mb=0)
    problems = [p.problem for p in PROBLEMS]
    steps = [split_steps(p.solution) for p in PROBLEMS]
    batched = prm.step_scores(problems, steps)
    assert [len(s) for s in batched] == [len(s) for s in steps]
    for problem, step_list, scores in zip(problems, steps, batched):
        assert np.all((scores > 0) & (scores < 1))
        np.testing.assert_allclose(prm.step_scores([problem], [step_list])[0], scores, atol=1e-5)
    # the score is P('+') / (P('+') + P('-')) of the full next-token distribution at each tag
    text = prm.text(problems[0], steps[0])
    ids = prm.tokenizer(text, return_tensors="pt")["input_ids"]
    logits = prm.model(ids).logits[0]
    at_tags = logits[ids[0] == prm.marker_id][:, prm.label_ids].softmax(-1)[:, 0]
    np.testing.assert_allclose(batched[0], at_tags.detach().numpy(), atol=1e-5)


def test_shepherd_prm_scores_a_whole_solution_step_by_step(untrained_policy_dir):
    # --action_level solution hands the PRM one action holding every step: it must read them as steps
    prm = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False)
    problems = [p.problem for p in PROBLEMS]
    split = prm.step_scores(problems, [split_steps(p.solution) for p in PROBLEMS])
    whole = prm.step_scores(problems, [[p.solution] for p in PROBLEMS])
    for want, have in zip(split, whole):
        assert len(want) >= 2
        np.testing.assert_allclose(have, want, atol=1e-5)
    # cut the text just after its first marker: the first step drops out, the others keep their score
    ids = prm.tokenizer(prm.text(problems[0], [PROBLEMS[0].solution]))["input_ids"]
    short = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False,
                               max_length=len(ids) - ids.index(prm.marker_id) - 1)
    assert len(short.step_scores(problems[:1], [[PROBLEMS[0].solution]])[0]) == len(split[0]) - 1


def test_prm_reads_only_the_markers_it_places(untrained_policy_dir):
    # a policy that writes the step tag itself must not add scores or move the real ones
    prm = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False)
    steps = split_steps(PROBLEMS[0].solution)
    injected = [f"{prm.marker} {steps[0]} {prm.marker}", *steps[1:]]
    assert prm.text(PROBLEMS[0].problem, injected).count(prm.marker) == len(steps)
    (scores,) = prm.step_scores([PROBLEMS[0].problem + prm.marker], [injected])
    assert len(scores) == len(steps)


def test_shepherd_prm_rewards_per_aggregation(untrained_policy_dir):
    contexts = contexts_for(PROBLEMS[:3]) + contexts_for(PROBLEMS[3:], done=False)
    step = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False)
    scores = step.step_scores([c.problem.problem for c in contexts], [c.steps for c in contexts])
    np.testing.assert_allclose(step.score(contexts).rewards, [s[-1] for s in scores])
    minimum = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, aggregation="min")
    np.testing.assert_allclose(minimum.score(contexts).rewards, [s.min() for s in scores[:3]] + [0, 0, 0], atol=1e-6)
    with pytest.raises(ValueError, match="step tag 'the answer'"):
        ProcessRewardModel(untrained_policy_dir, device="cpu", step_tag="the answer")


def with_separator(tokenizer):
    """A copy of ``tokenizer`` with Qwen2.5-Math-PRM's step separator as a token."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    return tokenizer


def save_classifier(tokenizer, out, num_labels: int = 2):
    """A 1-layer Qwen2 token classifier with Qwen2.5-Math-PRM's separator, saved to ``out``."""
    tokenizer = with_separator(tokenizer)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForTokenClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_classifier_prm_reads_separator_positions(tiny_tokenizer, tmp_path):
    torch.manual_seed(0)
    prm = ProcessRewardModel(save_classifier(tiny_tokenizer, tmp_path), prm_type="classifier", device="cpu")
    steps = split_steps(PROBLEMS[0].solution)
    (scores,) = prm.step_scores([PROBLEMS[0].problem], [steps])
    ids = prm.tokenizer(prm.text(PROBLEMS[0].problem, steps), return_tensors="pt")["input_ids"]
    expected = prm.model(ids).logits[0][ids[0] == prm.marker_id].softmax(-1)[:, 1]
    assert len(scores) == len(steps)
    np.testing.assert_allclose(scores, expected.detach().numpy(), atol=1e-5)


def test_a_language_model_is_refused_as_a_shepherd_prm(untrained_policy_dir):
    check_prm_dir(untrained_policy_dir, role="--prm_model_name_or_path")  # its tokens are single tokens...
    stand_in = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False)
    assert stand_in.label_odds() < MIN_LABEL_ODDS  # ...but nothing makes it write a label after the tag
    with pytest.raises(ModelDirError, match=re.escape(f"{str(untrained_policy_dir)!r} is not a Math-Shepherd PRM")):
        ProcessRewardModel(untrained_policy_dir, device="cpu")
    with pytest.raises(ModelDirError, match=r"^--prm_model_name_or_path=.*step tag 'the answer' is \d+ tokens .*"
                                            r"set step_tag \(--prm_step_tag\)"):
        check_prm_dir(untrained_policy_dir, step_tag="the answer", role="--prm_model_name_or_path")


def test_classifier_prm_needs_a_two_class_token_head(tiny_tokenizer, untrained_policy_dir, tmp_path):
    check_prm_dir(save_classifier(tiny_tokenizer, tmp_path / "prm"), "classifier")
    with pytest.raises(ModelDirError, match=r"separator '<extra_0>' is \d+ tokens .* set separator"):
        check_prm_dir(untrained_policy_dir, "classifier")
    causal_lm = shutil.copytree(untrained_policy_dir, tmp_path / "causal_lm")
    with_separator(tiny_tokenizer).save_pretrained(causal_lm)  # the separator is a token: only the head is wrong
    three_labels = save_classifier(tiny_tokenizer, tmp_path / "three", num_labels=3)
    for directory, what in [(causal_lm, r"\['LlamaForCausalLM'\] with 2 labels"),
                            (three_labels, r"\['Qwen2ForTokenClassification'\] with 3 labels")]:
        with pytest.raises(ModelDirError, match=f"^--prm_model_name_or_path={re.escape(repr(str(directory)))} is "
                                                f"not a classifier PRM: its config.json declares {what}"):
            check_prm_dir(directory, "classifier", role="--prm_model_name_or_path")
        with pytest.raises(ModelDirError, match="not a classifier PRM"):
            ProcessRewardModel(directory, prm_type="classifier", device="cpu")


@torch.no_grad()
def hand_log_prob_sum(model, prompt_ids, action_ids) -> float:
    ids = torch.tensor([prompt_ids + action_ids])
    log_probs = model(ids).logits[0, :-1].log_softmax(-1)
    targets = ids[0, 1:]
    return float(log_probs[torch.arange(len(targets)), targets][len(prompt_ids) - 1:].sum())


def test_implicit_prm_reward_by_hand_and_update_direction(untrained_policy_dir):
    prm = ImplicitPRM(LanguagePolicy(untrained_policy_dir, device="cpu"), beta=0.5, lr=1e-4, norm="none")
    tokenizer = prm.model.tokenizer
    prompts = [tokenizer.encode(format_prompt(p.problem)) for p in PROBLEMS[:4]]
    actions = [tokenizer.encode(join_steps(split_steps(p.solution)), add_special_tokens=False) for p in PROBLEMS[:4]]
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])

    def sequence_probability():
        with torch.no_grad():
            log_ratio, _ = prm.log_ratios(prompts, actions)
        return torch.sigmoid(prm.beta * log_ratio.sum(-1))

    before = sequence_probability()
    torch.testing.assert_close(before, torch.full((4,), 0.5))  # psi starts as ref
    torch.testing.assert_close(prm.outcome_scores(prompts, actions), torch.zeros(4))  # psi is ref: no opinion
    loss_before, scores_before = prm.update(prompts, actions, labels)
    torch.testing.assert_close(scores_before, torch.zeros(4))  # the scores the step started from
    torch.testing.assert_close(torch.sigmoid(prm.outcome_scores(prompts, actions)), sequence_probability())
    after = sequence_probability()
    loss_after = float(torch.nn.functional.binary_cross_entropy(after, labels))
    # one step lowers the cross-entropy and separates the correct answers from the wrong ones
    assert loss_after < loss_before == pytest.approx(math.log(2))
    assert after[labels == 1].min() > after[labels == 0].max(), after

    ref_log_probs = prm.reference_log_probs(prompts, actions)
    rewards, scores = prm.token_rewards(prompts, actions)
    torch.testing.assert_close(scores, prm.outcome_scores(prompts, actions))
    given, _ = prm.token_rewards(prompts, actions, ref_log_probs=ref_log_probs)  # the frozen reference's, passed in
    assert torch.equal(given, rewards)
    reference = AutoModelForCausalLM.from_pretrained(untrained_policy_dir)
    for b in range(4):
        by_hand = prm.beta * (hand_log_prob_sum(prm.model.causal_lm, prompts[b], actions[b])
                              - hand_log_prob_sum(reference, prompts[b], actions[b]))
        assert float(rewards[b].sum()) == pytest.approx(by_hand, abs=1e-4)
    whole_prm = ImplicitPRM(LanguagePolicy(untrained_policy_dir, device="cpu"), beta=0.5, granularity="whole",
                            norm="none")
    whole_prm.model.load_state_dict(prm.model.state_dict())
    whole_rewards, _ = whole_prm.token_rewards(prompts, actions)
    torch.testing.assert_close(whole_rewards.sum(-1), rewards.sum(-1), atol=1e-5, rtol=0)
    assert int((whole_rewards != 0).sum()) == 4  # one summed reward per action, at its last token

    # batch_norm (PRIME's default): the same rewards over the batch's largest |return-to-go|
    prm.norm = PrimeNorm.BATCH_NORM
    normed, _ = prm.token_rewards(prompts, actions)
    largest = rewards.flip(-1).cumsum(-1).flip(-1).abs().max()
    torch.testing.assert_close(normed, rewards / (largest + 1e-6))
    assert float(normed.flip(-1).cumsum(-1).flip(-1).abs().max()) == pytest.approx(1.0, abs=1e-5)
    # under data parallelism the batch's maximum is every process's: a larger one elsewhere scales these down
    torch.testing.assert_close(prm.token_rewards(prompts, actions, batch_max=lambda mine: 2 * mine)[0],
                               rewards / (2 * largest + 1e-6))


def test_blank_lines_end_steps_by_hand():
    """A blank line ends a step at its last token: a token ending with "\n\n", or a lone "\n" after a token
    ending with "\n"; a run of line breaks ends one step; tokens past the mask end none."""
    blank_lines = BlankLines(ending=torch.tensor([9]), lone=torch.tensor([5]), ending_line=torch.tensor([5, 9]))
    ids = torch.tensor([[1, 5, 5, 2, 9, 3],   # "\n" after a plain token is no blank line; "\n", "\n" is one
                        [1, 9, 5, 2, 9, 9]])  # "\n\n" then "\n": one step end at the run's last token
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    assert blank_lines.step_ends(ids, mask).tolist() == [[False, False, True, False, True, False],
                                                         [False, False, True, False, False, False]]


def test_step_granularity_sums_each_blank_line_delimited_step(untrained_policy_dir):
    """``step``: each step's summed token rewards, paid at its last token, steps ending at blank lines (the tiny
    tokenizer's "\n\n" and "\n" tokens both) and at the response's end; ``whole``: the sum at the last token."""
    prms = {granularity: ImplicitPRM(LanguagePolicy(untrained_policy_dir, device="cpu"), beta=0.5, lr=1e-2,
                                     norm="none", granularity=granularity)
            for granularity in ("token", "step", "whole")}
    tokenizer = prms["token"].model.tokenizer
    prompts = [tokenizer.encode(format_prompt(p.problem)) for p in PROBLEMS[:2]]
    actions = [tokenizer.encode(text, add_special_tokens=False)
               for text in ("2 + 3 = 5.\n\nSo 5 + 1 = 6.\n\n\nThe answer is 6.", "5 + 1 = 6.\n\n")]
    prms["token"].update(prompts, actions, torch.tensor([1.0, 0.0]))  # psi moves off pi_ref: rewards not 0
    for granularity in ("step", "whole"):
        prms[granularity].model.load_state_dict(prms["token"].model.state_dict())
    rewards = {granularity: prm.token_rewards(prompts, actions)[0] for granularity, prm in prms.items()}
    assert rewards["token"][0].abs().min() > 0  # the longer action's: every token is paid
    for row, action in enumerate(actions):
        texts = [tokenizer.decode(action[:end + 1]) for end in range(len(action))]
        ends = [end for end, text in enumerate(texts)
                if end == len(action) - 1 or text.endswith("\n\n") and not texts[end + 1].endswith("\n\n")]
        assert ends == ([6, 16, 21] if row == 0 else [6])
        starts = [0] + [end + 1 for end in ends[:-1]]
        by_hand = torch.zeros_like(rewards["token"][row])
        for start, end in zip(starts, ends):
            by_hand[end] = rewards["token"][row, start:end + 1].sum()
        torch.testing.assert_close(rewards["step"][row], by_hand, atol=1e-6, rtol=0)
        whole = torch.zeros_like(by_hand)
        whole[len(action) - 1] = rewards["token"][row].sum()
        torch.testing.assert_close(rewards["whole"][row], whole, atol=1e-6, rtol=0)


def test_min_form_weights_each_row_towards_its_lowest_reward_by_hand():
    rewards = torch.tensor([[0.5, -0.5, 0.0, 9.0], [0.2, 0.2, 0.0, 0.0]])
    positions = torch.tensor([[True, True, True, False], [True, True, False, False]])
    weighted = min_form(rewards, positions, temperature=0.1)
    first = torch.softmax(torch.tensor([-5.0, 5.0, 0.0]), 0)  # -r / T over the row's three positions
    torch.testing.assert_close(weighted[0], torch.cat([first * torch.tensor([0.5, -0.5, 0.0]), torch.zeros(1)]))
    torch.testing.assert_close(weighted[1], torch.tensor([0.1, 0.1, 0.0, 0.0]))  # equal rewards: their mean
    assert float(weighted[0].sum()) == pytest.approx(-0.5 * float(first[1]) + 0.5 * float(first[0]))
    assert -0.5 < float(weighted[0].sum()) < -0.49  # near the minimum, -0.5
    # a large temperature gives the plain mean; a row without positions stays 0
    torch.testing.assert_close(min_form(rewards, positions, 1e9)[0, :3].sum(), torch.tensor(0.0))
    assert not min_form(rewards, torch.zeros_like(positions), 0.1).any()


def test_implicit_prm_min_form_weights_its_token_rewards(untrained_policy_dir):
    """After a step the PRM's min_form rewards are its sum_form ones through ``min_form``: their sum lies within
    the rewards' range instead of adding them up; the outcome score stays the plain sum."""
    prm = ImplicitPRM(LanguagePolicy(untrained_policy_dir, device="cpu"), beta=0.5, lr=1e-3, norm="none")
    tokenizer = prm.model.tokenizer
    prompt = tokenizer.encode(format_prompt(PROBLEMS[0].problem))
    answer = tokenizer.encode(join_steps(split_steps(PROBLEMS[0].solution)), add_special_tokens=False)
    prm.update([prompt] * 2, [answer] * 2, torch.tensor([1.0, 0.0]))  # psi leaves ref: rewards not all 0
    raw, _ = prm.token_rewards([prompt], [answer])
    prm.credit = ProcessCredit.MIN_FORM
    weighted, scores = prm.token_rewards([prompt], [answer])
    positions = (torch.arange(raw.shape[1]) < len(answer))[None]
    torch.testing.assert_close(weighted, min_form(raw, positions, prm.min_form_temperature))
    torch.testing.assert_close(scores, raw.sum(-1))
    assert raw.min() <= weighted.sum() <= raw.max()
    with pytest.raises(ValueError, match="min_form_temperature"):
        ImplicitPRM(LanguagePolicy(untrained_policy_dir, device="cpu"), min_form_temperature=0.0)


def test_implicit_prm_step_clips_its_gradient_norm(untrained_policy_dir):
    """``grad_clip`` (PRIME's reward_model optim.grad_clip): ``step`` returns the gradient norm before the clip, and
    the step is taken on the clipped gradient. AdamW's first step moves a weight by about lr whatever the gradient's
    scale, unless the gradient is below its eps (1e-8): a clip of 1e-12 puts it there, and the weights barely move."""
    with pytest.raises(ValueError, match="grad_clip=0.0 must be > 0"):
        ImplicitPRM(LanguagePolicy(untrained_policy_dir, device="cpu"), grad_clip=0.0)
    moved, norms = {}, {}
    for clip in (10.0, 1e-12):
        prm = ImplicitPRM(LanguagePolicy(untrained_policy_dir, device="cpu"), beta=0.5, lr=1e-3, grad_clip=clip)
        tokenizer = prm.model.tokenizer
        prompts = [tokenizer.encode(format_prompt(p.problem)) for p in PROBLEMS[:4]]
        actions = [tokenizer.encode(join_steps(split_steps(p.solution)), add_special_tokens=False)
                   for p in PROBLEMS[:4]]
        start = [p.detach().clone() for p in prm.model.actor_parameters()]
        prm.accumulate(prompts, actions, torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
        by_hand = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                        for p in prm.model.actor_parameters()]))
        norms[clip] = prm.step()
        assert norms[clip] == pytest.approx(float(by_hand), rel=1e-5)
        moved[clip] = max(float((a - b.detach()).abs().max()) for a, b in zip(start, prm.model.actor_parameters()))
    assert norms[10.0] == pytest.approx(norms[1e-12])
    assert moved[10.0] == pytest.approx(1e-3, rel=1e-3)
    assert moved[1e-12] < 1e-3 * moved[10.0]


# ---------------------------------------------------------------------------------------------
# Trained tiny models (slow)
# ---------------------------------------------------------------------------------------------

def corrupt(step: str, offset: int) -> str:
    """'a op b = c' -> 'a op b = c+offset'; the final step's boxed value likewise."""
    if step.startswith("The answer"):
        value = int(re.search(r"\\boxed\{(-?\d+)\}", step).group(1))
        return f"The answer is \\boxed{{{value + offset}}}."
    left, result = step.rsplit(" = ", 1)
    return f"{left} = {int(result) + offset}"


@pytest.mark.slow
def test_tiny_prm_ranks_correct_steps_above_corrupted(tiny_models):
    prm = ProcessRewardModel(tiny_models.prm, device="cpu", batch_size=64)
    rng = np.random.default_rng(0)
    problems = Arith().problems(300, seed=98765)
    good, bad = [], []
    for problem in problems:
        steps = split_steps(problem.solution)
        k = int(rng.integers(0, len(steps)))
        good.append((problem.problem, steps[: k + 1]))
        bad.append((problem.problem, steps[:k] + [corrupt(steps[k], int(rng.choice([-10, -2, -1, 1, 2, 10])))]))
    good_scores = [s[-1] for s in prm.step_scores([p for p, _ in good], [s for _, s in good])]
    bad_scores = [s[-1] for s in prm.step_scores([p for p, _ in bad], [s for _, s in bad])]
    auc = roc_auc(np.array(good_scores + bad_scores), np.repeat([1, 0], [len(good_scores), len(bad_scores)]))
    print(f"tiny PRM ROC-AUC on {len(good)} correct vs {len(bad)} corrupted held-out steps: {auc:.3f}")
    assert auc >= 0.9


@pytest.mark.slow
def test_tiny_prm_scores_its_labels_and_the_tiny_policies_do_not(tiny_models):
    check_prm_dir(tiny_models.prm)
    odds = ProcessRewardModel(tiny_models.prm, device="cpu").label_odds()
    print(f"label odds at the step tags: tiny PRM {odds:.3g}")
    assert odds > 3 * MIN_LABEL_ODDS
    for policy in (tiny_models.policy, tiny_models.target):
        with pytest.raises(ModelDirError, match="is not a Math-Shepherd PRM: after its step tag 'ки' the labels "
                                                r"'\+'/'-' are .* times as likely as its likeliest other next token"):
            ProcessRewardModel(policy, device="cpu")


def test_target_solver_samples_each_context_alike_however_the_calls_are_split(untrained_policy_dir):
    """A context's completions depend on (seed, group id, prefix), never on its position in a call: the
    same under one process and several ranks. Identical prefixes of one group still differ."""
    generator = HFGenerator(LanguagePolicy(untrained_policy_dir, device="cpu"))
    solver = TargetSolver(generator, num_samples=2, max_new_tokens=6, temperature=1.0, seed=7)
    problem = Arith().problems(1, seed=0)[0]
    a, b = (StepContext(problem, (), step, done=True, group_id=group) for step, group in (("12 + 3", 4), ("9 - 1", 5)))

    def completions(contexts):
        output = generator.generate(solver.prompts(contexts), n=2, max_new_tokens=6, temperature=1.0,
                                    seed=solver.seeds(contexts))
        return [output.texts[2 * i:2 * i + 2] for i in range(len(contexts))]

    whole = completions([a, b, a])
    assert [completions([b])[0], *completions([a, a])] == [whole[1], whole[0], whole[2]]
    assert whole[0] != whole[2], "two identical prefixes of a group drew the same completions"
    moved = StepContext(problem, (), "12 + 3", done=True, group_id=6)
    assert len(set(solver.seeds([a, moved, a]))) == 3


@pytest.mark.slow
def test_target_solver_rewards_correct_prefixes_more(tiny_models):
    generator = HFGenerator(LanguagePolicy(tiny_models.target, device="cpu"), batch_size=64)
    solver = TargetSolver(generator, max_new_tokens=48)
    problems = [p for p in Arith(min_ops=2).problems(200, seed=4242)]
    correct = [StepContext(p, (), split_steps(p.solution)[0], done=True) for p in problems]
    corrupted = [StepContext(p, (), corrupt(split_steps(p.solution)[0], 7), done=True) for p in problems]
    correct_rate = solver.score(correct).rewards.mean()
    corrupted_rate = solver.score(corrupted).rewards.mean()
    print(f"target solve rate with a correct 1-step prefix {correct_rate:.3f}, corrupted {corrupted_rate:.3f}")
    assert correct_rate > corrupted_rate + 0.2
    unfinished = StepContext(problems[0], (), "x", done=False)
    assert solver.score([unfinished]).rewards.tolist() == [0.0]
    with pytest.raises(ValueError, match="greedy completions would all be the same"):
        TargetSolver(generator, num_samples=4, temperature=0.0)


@pytest.mark.slow
def test_env_with_tiny_prm_pays_step_scores(tiny_models):
    from envs.vector import MathVectorEnv

    prm = ProcessRewardModel(tiny_models.prm, device="cpu")
    # two-digit operands, as in every Arith problem the tiny models saw (it flags "10 + 5 = 15": its
    # trunk never read a one-digit operand)
    env = MathVectorEnv(num_envs=4, problems=[Problem("q", "Compute 12 + 35.", "47")], reward_model=prm)
    env.reset(seed=0)
    _, rewards, *_ = env.step(["12 + 35 = 47", "12 + 35 = 47", "12 + 35 = 48", "12 + 35 = 74"])
    print(f"tiny PRM pays {rewards} for a right step (twice) and two wrong ones")
    assert rewards[0] == rewards[1] and min(rewards[:2]) > max(rewards[2:]) + 0.5
