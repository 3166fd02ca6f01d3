"""Credit assignment in a multi-agent episode (``envs.multi_agent``): which answer comparisons one env step
needs, deciding them in one time-bounded grading call, and how the verified outcome is credited to the agent
slots by ``reward_assignment``: ``team``, the final answer's verdict to every slot that acted; ``individual``,
each message's own verified output (a role with none gets the team outcome); ``counterfactual``, the team outcome
minus that of ``Workflow.replay`` with the slot's messages replaced by its role's default. Besides the credit, a
step's verified outputs per slot (``ROLE_METRICS`` of the env) and the final answers of the episodes that ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from envs.grader import grade_batch
from envs.modes import AnswerRule, RewardAssignment
from envs.workflows import Dialogue, DialogueLimits, Workflow

MessageRef = tuple[int, int]  # (env index, index of the message in that env's transcript)
Candidates = tuple[str | None, ...]  # the answers a final answer is chosen from (None: a message without one)


class AnswerChecks:
    """The answer comparisons one env step needs: asked first, then decided in one ``grade_batch`` call."""

    def __init__(self) -> None:
        self.asked: dict[tuple[str, str], None] = {}  # an ordered set of (pred, gold) pairs
        self.verdicts: dict[tuple[str, str], bool] = {}

    def ask(self, pred: str | None, gold: str) -> None:
        if pred is not None:
            self.asked[(pred, gold)] = None

    def ask_candidates(self, candidates: Candidates, gold: str) -> None:
        """Each candidate against ``gold``, and pairwise, each before the later ones (a vote groups the
        equivalent ones)."""
        for k, answer in enumerate(candidates):
            self.ask(answer, gold)
            for other in candidates[k + 1:]:
                if other is not None:
                    self.ask(answer, other)

    def grade(self, timeout: float) -> None:
        pairs = list(self.asked)
        if pairs:
            verdicts = grade_batch([pred for pred, _ in pairs], [gold for _, gold in pairs], timeout=timeout)
            self.verdicts = dict(zip(pairs, verdicts))

    def equivalent(self, pred: str | None, gold: str) -> bool:
        """The verdict on a pair that was asked (None, no answer, is never right)."""
        return pred is not None and self.verdicts[(pred, gold)]


@dataclass(frozen=True)
class Outcome:
    """An ended episode's final-answer candidates: ``actual``, those of its transcript; ``without`` {slot:
    candidates}, for counterfactual credit, those of its replay with the slot's messages replaced by its role's
    default (``Workflow.replay``), one per slot that acted (empty under the other credits)."""

    actual: Candidates
    without: dict[int, Candidates]

    def all_candidates(self) -> list[Candidates]:
        """The actual candidates, then each replay's: the order their comparisons are asked in."""
        return [self.actual, *self.without.values()]


@dataclass(frozen=True)
class StepCredit:
    """What grading one env step gave: ``outputs`` {name: [N, A]} each slot's verified output and its rates (the
    env's ``ROLE_METRICS``), ``correct`` [N] and ``final_answers`` [N] of the episodes that ended (NaN and None
    elsewhere), ``rewards`` [N, A] the "outcome" source's credit and ``credited`` [N, A] the slots it concerns."""

    outputs: dict[str, np.ndarray]
    correct: np.ndarray
    final_answers: np.ndarray
    rewards: np.ndarray
    credited: np.ndarray


@dataclass(frozen=True)
class Credit:
    """Grades and credits the steps of ``workflow``'s episodes by ``reward_assignment``; a counterfactual replay
    reads the task's prompt ``template`` and the episodes' ``limits``."""

    workflow: Workflow
    reward_assignment: RewardAssignment
    template: str
    limits: DialogueLimits

    def step(self, dialogues: Sequence[Dialogue], new_messages: list[MessageRef], ended: Sequence[int],
             timeout: float) -> StepCredit:
        """The credit of one env step's ``new_messages`` and of the episodes of the envs ``ended`` that ended at it,
        every comparison decided in one grading call bounded by ``timeout`` seconds each."""
        checks = AnswerChecks()
        verified, revisions = self._ask_message_checks(dialogues, new_messages, checks)
        outcomes = {i: self._outcome(dialogues, i) for i in ended}
        self._ask_outcome_checks(dialogues, outcomes, checks)
        checks.grade(timeout)
        outputs = self._message_outputs(dialogues, new_messages, verified, checks)
        correct, final_answers = self._final_answers(dialogues, outcomes, checks)
        rewards = self._credit(dialogues, outputs, outcomes, correct, checks)
        outputs.update(self._role_rates(dialogues, new_messages, outputs, revisions, checks))
        outputs["agrees_with_vote"] = self._agreement(dialogues, outcomes, checks)
        return StepCredit(outputs, correct, final_answers, rewards, self._credited(dialogues, new_messages, outcomes))

    def _ask_message_checks(self, dialogues: Sequence[Dialogue], new_messages: list[MessageRef], checks: AnswerChecks
                            ) -> tuple[dict[MessageRef, str | None], dict[MessageRef, str | None]]:
        """Asks ``checks`` about the answers the ``new_messages`` are verified by. Returns ``verified``
        {message: answer}, the answer a message's individual credit verifies (an answering role's own, a
        judge's the one it judges), and ``revisions`` {answering message: the judged answer it revises
        (``Workflow.revised``)}."""
        verified, revisions = {}, {}
        for i, index in new_messages:
            dialogue = dialogues[i]
            role = self.workflow.roles[dialogue.transcript[index].slot]
            verified_index = index if role.answers else None
            if role.judges is not None:
                verified_index = self.workflow.judged(dialogue.transcript, index)
            if verified_index is not None:
                verified[(i, index)] = self.workflow.answer_of(dialogue.transcript, verified_index)
                checks.ask(verified[(i, index)], dialogue.problem.answer)
            revised_index = self.workflow.revised(dialogue.transcript, index) if role.answers else None
            if revised_index is not None:
                revisions[(i, index)] = self.workflow.answer_of(dialogue.transcript, revised_index)
                checks.ask(revisions[(i, index)], dialogue.problem.answer)
        return verified, revisions

    def _ask_outcome_checks(self, dialogues: Sequence[Dialogue], outcomes: dict[int, Outcome],
                            checks: AnswerChecks) -> None:
        """Asks ``checks`` about every candidate of the ended episodes' ``outcomes``: against the gold answer,
        and pairwise (a vote groups equivalent candidates)."""
        for i, outcome in outcomes.items():
            for candidates in outcome.all_candidates():
                checks.ask_candidates(candidates, dialogues[i].problem.answer)

    def _outcome(self, dialogues: Sequence[Dialogue], env_index: int) -> Outcome:
        """The ``Outcome`` of env ``env_index``'s ended episode: its transcript's final-answer candidates and,
        for counterfactual credit, those of its replay without each slot that acted."""
        dialogue = dialogues[env_index]
        without = {}
        if self.reward_assignment == RewardAssignment.COUNTERFACTUAL:
            for slot in dialogue.acted():
                replay = self.workflow.replay(dialogue.problem.problem, self.template, dialogue.transcript, slot,
                                              self.limits)
                without[slot] = self.workflow.candidates(replay)
        return Outcome(self.workflow.candidates(dialogue.transcript), without)

    def _solved(self, dialogues: Sequence[Dialogue], env_index: int, candidates: Candidates,
                checks: AnswerChecks) -> tuple[str | None, float]:
        """The final answer chosen from ``candidates`` and its graded verdict (1.0 / 0.0) on env ``env_index``'s
        problem."""
        final = self.workflow.final_answer(candidates, checks.equivalent)
        return final, float(checks.equivalent(final, dialogues[env_index].problem.answer))

    def _final_answers(self, dialogues: Sequence[Dialogue], outcomes: dict[int, Outcome],
                       checks: AnswerChecks) -> tuple[np.ndarray, np.ndarray]:
        """``correct`` [N] float64 and ``final_answers`` [N] object of the ended episodes' transcripts, NaN and
        None elsewhere."""
        correct, final_answers = np.full(len(dialogues), np.nan), np.full(len(dialogues), None, dtype=object)
        for i, outcome in outcomes.items():
            final_answers[i], correct[i] = self._solved(dialogues, i, outcome.actual, checks)
        return correct, final_answers

    def _message_outputs(self, dialogues: Sequence[Dialogue], new_messages: list[MessageRef],
                         verified: dict[MessageRef, str | None], checks: AnswerChecks) -> dict[str, np.ndarray]:
        """Each new message's verified output [N, A], NaN where a slot gave none: ``answer_correct`` (an
        answering role's answer), ``verdict`` (a judge's, 1 accept) and ``verdict_correct`` (the verdict
        agrees with the truth of the answer it judged)."""
        shape = (len(dialogues), len(self.workflow.roles))
        answer_correct, verdict, verdict_correct = (np.full(shape, np.nan) for _ in range(3))
        for i, index in new_messages:
            message = dialogues[i].transcript[index]
            role = self.workflow.roles[message.slot]
            if role.judges is not None:
                verdict[i, message.slot] = role.verdict(message.text, verified.get((i, index))) is True
            if (i, index) in verified:
                right = checks.equivalent(verified[(i, index)], dialogues[i].problem.answer)
                if role.answers:
                    answer_correct[i, message.slot] = right
                else:
                    verdict_correct[i, message.slot] = verdict[i, message.slot] == right
        return {"answer_correct": answer_correct, "verdict": verdict, "verdict_correct": verdict_correct}

    def _credit(self, dialogues: Sequence[Dialogue], outputs: dict[str, np.ndarray], outcomes: dict[int, Outcome],
                correct: np.ndarray, checks: AnswerChecks) -> np.ndarray:
        """The "outcome" source's rewards [N, A] by ``reward_assignment``: ``individual`` pays each message's
        verified output as it is said; at an episode's end every slot that acted is paid ``correct`` (team),
        ``correct`` less its counterfactual's (counterfactual) or, under individual credit, ``correct`` when
        its role has no output of its own to verify."""
        rewards = np.zeros((len(dialogues), len(self.workflow.roles)))
        if self.reward_assignment == RewardAssignment.INDIVIDUAL:
            rewards = np.nan_to_num(np.fmax(outputs["answer_correct"], outputs["verdict_correct"]))
        roles = self.workflow.roles
        for i, outcome in outcomes.items():
            acted = dialogues[i].acted()
            if self.reward_assignment == RewardAssignment.COUNTERFACTUAL:
                rewards[i, acted] = [correct[i] - self._solved(dialogues, i, outcome.without[slot], checks)[1]
                                     for slot in acted]
            elif self.reward_assignment == RewardAssignment.TEAM:
                rewards[i, acted] = correct[i]
            else:
                rewards[i, [s for s in acted if not roles[s].answers and roles[s].judges is None]] = correct[i]
        return rewards

    def _role_rates(self, dialogues: Sequence[Dialogue], new_messages: list[MessageRef],
                    outputs: dict[str, np.ndarray], revisions: dict[MessageRef, str | None],
                    checks: AnswerChecks) -> dict[str, np.ndarray]:
        """The verdicts and the revising answers of ``new_messages`` split by the truth of what they judged or
        revised, [N, A] each, NaN outside the condition (see ``envs.multi_agent``'s docstring)."""
        verdict, verdict_correct = outputs["verdict"], outputs["verdict_correct"]
        nan = np.full_like(verdict, np.nan)
        judged_right = np.where(np.isnan(verdict_correct), nan, np.where(verdict_correct == 1, verdict, 1 - verdict))
        rates = {"verdict_precision": np.where(verdict == 1, judged_right, nan),
                 "verdict_recall": np.where(judged_right == 1, verdict, nan),
                 "verdict_specificity": np.where(judged_right == 0, 1 - verdict, nan),
                 "fix_rate": nan.copy(), "keep_rate": nan.copy()}
        for (i, index), revised_answer in revisions.items():
            slot = dialogues[i].transcript[index].slot
            key = "keep_rate" if checks.equivalent(revised_answer, dialogues[i].problem.answer) else "fix_rate"
            rates[key][i, slot] = outputs["answer_correct"][i, slot]
        return rates

    def _agreement(self, dialogues: Sequence[Dialogue], outcomes: dict[int, Outcome],
                   checks: AnswerChecks) -> np.ndarray:
        """[N, A] in a vote's ended episodes, each candidate slot's answer in the winning group (1) or not (0: an
        answer outvoted, or none), NaN elsewhere: the debaters' answers collapsing into one read as 1 for all."""
        agrees = np.full((len(dialogues), len(self.workflow.roles)), np.nan)
        if self.workflow.answer is not AnswerRule.VOTE:
            return agrees
        for i, outcome in outcomes.items():
            groups = self.workflow.vote_groups(outcome.actual, checks.equivalent)
            winners = max(groups, key=len) if groups else []
            transcript = dialogues[i].transcript
            for k, index in enumerate(self.workflow.candidate_indices(transcript)):
                agrees[i, transcript[index].slot] = k in winners
        return agrees

    def _credited(self, dialogues: Sequence[Dialogue], new_messages: list[MessageRef],
                  outcomes: dict[int, Outcome]) -> np.ndarray:
        """[N, A] the slots the outcome credit concerns at this step: those that spoke, and every slot that
        acted in an episode that ended."""
        credited = np.zeros((len(dialogues), len(self.workflow.roles)), dtype=bool)
        for i, index in new_messages:
            credited[i, dialogues[i].transcript[index].slot] = True
        for i in outcomes:
            credited[i, dialogues[i].acted()] = True
        return credited
